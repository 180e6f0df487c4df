"""The planner (``python -m hpcdl.plan``): its counts against explicit sums, its step
times against Megatron-LM's published weak-scaling runs, its layouts and its command."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from collectives.cost import (
    LINKS,
    AlphaBeta,
    fit,
    link_from_allreduce,
    parse_link,
    ring_allgather,
    ring_allreduce,
    ring_reduce_scatter,
)
from hpcdl.plan import (
    GPT,
    GPUS,
    MEGATRON_RECOMPUTATION,
    MEGATRON_WEAK_SCALING,
    MODELS,
    Cluster,
    Layout,
    Placement,
    attention_core_pass,
    estimate,
    layer_pass,
    main,
    placement,
    plan,
    validate,
    validate_recomputation,
)

PUBLISHED_BILLIONS = {  # parameters Megatron-LM's table gives each size
    "gpt-1.7b": 1.7,
    "gpt-3.6b": 3.6,
    "gpt-7.5b": 7.5,
    "gpt-18b": 18.4,
    "gpt-39b": 39.1,
    "gpt-76b": 76.1,
    "gpt-146b": 145.6,
    "gpt-310b": 310.1,
    "gpt-530b": 529.6,
    "gpt-1t": 1008.0,
}
SELENE = Cluster(gpus=8, gpu=GPUS["a100"], intra=LINKS["nvlink3"], inter=LINKS["ib-hdr"])


def _explicit_params(m: GPT) -> int:
    h = m.hidden
    shapes = [(h, 3 * h), (3 * h,), (h, h), (h,), (h, 4 * h), (4 * h,), (4 * h, h), (h,)] + [(h,)] * 4
    per_layer = sum(math.prod(s) for s in shapes)
    return m.layers * per_layer + m.vocab * h + m.seq * h + 2 * h


def test_parameters_match_an_explicit_count_and_megatrons_table():
    for name, billions in PUBLISHED_BILLIONS.items():
        m = MODELS[name]
        assert m.params() == _explicit_params(m), name
        assert round(m.params() / 1e9, 1) == billions, name


def test_flops_count_every_matrix_product_as_megatron_does():
    m = GPT(layers=6, hidden=512, heads=8, seq=256, vocab=1000)
    b, s, h, v = 4, m.seq, m.hidden, m.vocab
    # per layer forward: QKV, scores, scores x V, projection, the MLP's two; then the logits
    layer = (
        2 * b * s * h * 3 * h + 2 * b * s * s * h + 2 * b * s * s * h + 2 * b * s * h * h + 2 * 2 * b * s * h * 4 * h
    )
    logits = 2 * b * s * h * v
    plain = 3 * (m.layers * layer + logits)  # forward, and backward at twice its cost
    assert m.flops(b, recompute=False) == pytest.approx(plain, rel=1e-12)
    assert m.flops(b, recompute=True) == pytest.approx(plain + m.layers * layer, rel=1e-12)
    # selective recomputation: the attention core's two products, counted three times over
    # as Korthikanti et al. count them (72 B s l h² (1 + s / 3h + V / 12lh))
    core = 2 * b * s * s * h + 2 * b * s * s * h
    assert m.flops(b, recompute=False, selective=True) == pytest.approx(plain + 3 * m.layers * core, rel=1e-12)


def test_megatrons_selective_runs_reach_the_utilisation_they_published():
    # model and hardware FLOPs utilisation Korthikanti et al. give for each run (table 5):
    # the table's steps and this count of FLOPs must give them back
    published = {"gpt-22b": (41.5, 43.7), "gpt3-175b": (51.4, 52.8), "gpt-530b": (56.0, 57.0), "gpt-1t": (56.3, 57.0)}
    for name, _tp, _pp, gpus, batch, _full_s, seconds in MEGATRON_RECOMPUTATION:
        m, peak = MODELS[name], gpus * GPUS["a100"].peak * seconds / 100
        model_fu, hardware_fu = published[name]
        assert m.flops(batch, recompute=False) / peak == pytest.approx(model_fu, abs=0.3), name
        assert m.flops(batch, recompute=False, selective=True) / peak == pytest.approx(hardware_fu, abs=0.3), name


def test_ring_times_fit_back_to_the_link_they_ran_on():
    link = AlphaBeta(3e-6, 20e9)
    for n in (2, 3, 8, 64):
        sizes = [1 << k for k in range(10, 28, 3)]
        measured = fit([(sz, ring_allreduce(link, n, sz)) for sz in sizes])
        back = link_from_allreduce(measured, n)
        assert back.alpha == pytest.approx(link.alpha, rel=1e-6) and back.beta == pytest.approx(link.beta, rel=1e-6)
        assert ring_allgather(link, n, 1 << 20) == ring_reduce_scatter(link, n, 1 << 20)
        assert ring_allreduce(link, n, 1 << 20) == pytest.approx(2 * (n - 1) * (3e-6 + (1 << 20) / n / 20e9))
    assert ring_allreduce(link, 1, 1 << 20) == 0.0


def test_links_parse_from_names_and_units():
    assert parse_link("latency=5us,bandwidth=12.5GB/s") == AlphaBeta(pytest.approx(5e-6), 12.5e9)
    assert parse_link(" Latency = 2 ms , bandwidth=100Gbit/s") == AlphaBeta(pytest.approx(2e-3), 12.5e9)
    assert parse_link("bandwidth=800 MB/s") == AlphaBeta(0.0, 800e6)
    assert parse_link("IB-HDR") == LINKS["ib-hdr"] == AlphaBeta(2e-6, 25e9)
    for bad, why in (
        ("latency=5", "with a unit"),
        ("latency=-1us", "positive"),
        ("bandwidth=fast", "with a unit"),
        ("speed=1GB/s", "expected one of"),
        ("token-ring", "expected one of"),
        ("", "expected one of"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_link(bad)


@pytest.mark.parametrize("anchor", ["gpt-146b", "gpt-1.7b", "gpt-1t"])
def test_calibrated_on_one_megatron_run_it_predicts_the_others_within_15_percent(anchor):
    rows = validate(anchor, SELENE)
    assert [r["model"] for r in rows] == [r[0] for r in MEGATRON_WEAK_SCALING]
    assert 0.3 < rows[0]["efficiency"] < 0.9
    for r in rows:
        assert abs(r["error"]) < 0.15, r
        assert r["predicted_tflops"] == pytest.approx(r["published_tflops"] * (1 + r["error"]))
        if r["model"] == anchor:
            assert r["error"] == pytest.approx(0, abs=1e-6)
        assert r["chosen"]["step_s"] <= r["published_step_s"], f"{r['model']}: the choice is slower than published"
    with pytest.raises(ValueError, match="anchor 'gpt-2'"):
        validate("gpt-2", SELENE)


def test_validation_prints_from_the_command(capsys):
    assert main(["--validate"]) == 0
    out = capsys.readouterr().out
    assert "calibrated on gpt-146b" in out and len(out.splitlines()) == 2 + len(MEGATRON_WEAK_SCALING)


def test_memory_follows_the_zero_stage_and_recomputation():
    m, batch = MODELS["gpt-7.5b"], 512
    cl = replace(SELENE, gpus=64)
    mem = {z: estimate(m, batch, Layout(dp=16, tp=4, pp=1, micro_batch=2, zero=z), cl).memory for z in range(4)}
    phi = (m.layers * m.layer_params() + m.vocab * m.hidden) / 4 + m.seq * m.hidden + 2 * m.hidden
    assert mem[0]["parameters"] + mem[0]["gradients"] + mem[0]["optimizer"] == pytest.approx(16 * phi)
    assert mem[1]["optimizer"] == pytest.approx(12 * phi / 16) and mem[1]["gradients"] == mem[0]["gradients"]
    assert mem[2]["gradients"] == pytest.approx(2 * phi / 16) and mem[2]["parameters"] == mem[0]["parameters"]
    assert mem[3]["parameters"] == pytest.approx(2 * phi / 16)
    # on one GPU of one stage, every parameter of the model, the tied output layer once
    alone = estimate(m, batch, Layout(dp=64, tp=1, pp=1, micro_batch=8), cl).memory["parameters"]
    assert alone == 2 * m.params()
    keep = estimate(m, batch, Layout(dp=16, tp=4, pp=1, micro_batch=2, recompute=False), cl)
    again = estimate(m, batch, Layout(dp=16, tp=4, pp=1, micro_batch=2, recompute=True), cl)
    assert keep.memory["activations"] > 5 * again.memory["activations"]
    assert keep.step_s < again.step_s  # recomputing costs a forward pass


def test_a_model_too_large_for_its_gpus_is_refused_with_the_reason():
    ok, refused = plan(MODELS["gpt-1t"], 64, replace(SELENE, gpus=8))
    assert ok == [] and refused
    assert all("out of memory" in e.refused or "bubble" in e.refused for e in refused)
    assert refused == sorted(refused, key=lambda e: e.step_s)


def test_a_bad_layout_names_what_does_not_divide():
    m = MODELS["gpt-1.7b"]
    for lay, why in (
        (Layout(dp=3, tp=1, pp=1, micro_batch=1), "!= 8 GPUs"),
        (Layout(dp=8, tp=1, pp=1, micro_batch=3), "not a multiple"),
        (Layout(dp=1, tp=1, pp=8, micro_batch=1, chunks=2), "24 layers do not split into pp=8 x chunks=2"),
        (Layout(dp=1, tp=8, pp=1, micro_batch=1), "heads do not split"),
    ):
        with pytest.raises(ValueError, match=why):
            estimate(replace(m, heads=12, hidden=2304) if "heads" in why else m, 512, lay, SELENE)
    with pytest.raises(ValueError, match="4 layers do not fill pp=8 stages"):
        estimate(replace(m, layers=4), 512, Layout(dp=1, tp=1, pp=8, micro_batch=1), SELENE)
    with pytest.raises(ValueError, match="hidden=100 is not a multiple of heads=3"):
        GPT(layers=2, hidden=100, heads=3, seq=8, vocab=10)


BLOOM = GPT(layers=70, hidden=14336, heads=112, seq=2048, vocab=250880)
"""BigScience's BLOOM-176B: trained on 384 A100 80GB with tp=4, pp=12 (a model copy on 48
GPUs), micro-batches of 2, a global batch of 2048, at about 150 TFLOP/s per GPU (the
project's model card); nodes of 8 GPUs, 4 Omni-Path ports of 100 Gbit/s each."""


def test_stages_that_do_not_divide_the_layers_put_the_fewer_on_the_last_then_the_first():
    from hpcdl.plan import stage_layers

    assert stage_layers(24, 8) == (3,) * 8
    assert stage_layers(70, 12) == (5,) + (6,) * 10 + (5,)  # BLOOM's split
    assert stage_layers(5, 4) == (1, 1, 2, 1)
    assert stage_layers(7, 4) == (2, 2, 2, 1)
    for layers, pp in ((24, 8), (70, 12), (5, 4), (7, 4), (96, 20), (3, 3)):
        split = stage_layers(layers, pp)
        assert sum(split) == layers and max(split) == -(-layers // pp) and min(split) == layers // pp
    with pytest.raises(ValueError, match="3 layers do not fill pp=4 stages"):
        stage_layers(3, 4)


def test_uneven_stages_cost_the_slowest_stage_and_hold_the_heaviest_ones_memory():
    from hpcdl.plan import layer_pass

    cl = replace(SELENE, gpus=384, efficiency=0.6)
    lay = Layout(dp=8, tp=4, pp=12, micro_batch=2, zero=1, recompute=True)
    e = estimate(BLOOM, 2048, lay, cl)
    one = 4 * layer_pass(BLOOM, 2, 4, cl.gpu, 0.6)  # a layer: forward, recomputed forward, backward
    logits = 6 * 2 * 2048 * 14336 * 250880 / 4 / (0.6 * cl.gpu.peak)
    slowest = max(6 * one, 5 * one + logits)  # a middle stage's 6 layers, or the last's 5 and the logits
    assert e.micro_batches == 128
    # parameters: the first stage's 5 layers and the embedding outweigh a middle stage's 6
    h, layer = 14336, BLOOM.layer_params() / 4
    first = 5 * layer + 250880 * h / 4 + 2048 * h
    assert first > 6 * layer and e.memory["parameters"] == pytest.approx(2 * first)
    # every micro-batch the slowest stage's time, then Adam over its ZeRO-1 shard
    assert e.time["compute"] == pytest.approx(128 * slowest + 28 * first / 8 / cl.gpu.hbm)
    assert e.time["bubble"] == pytest.approx(11 * (slowest + (e.time["tp_comm"] + e.time["pp_comm"]) / 128))
    # activations: stage i keeps 12 - i micro-batches of its layers: the first 5 x 12, the second 6 x 11
    per_layer, full = 2 * 2048 * 2 * h, 2048 * 2 * h * (10 + 24 / 4 + 5 * 112 * 2048 / (h * 4))
    logit_bytes = 2 * 4 * 2048 * 2 * 250880 / 4
    assert e.memory["activations"] == pytest.approx(max(5 * 12, 6 * 11) * per_layer + full + logit_bytes)
    # an even split is the one Megatron-LM runs: its last stage's layers and the logits set the step
    even = estimate(replace(BLOOM, layers=72), 2048, lay, cl)
    assert even.time["compute"] == pytest.approx(128 * (6 * one + logits), rel=0.01)
    assert even.step_s > e.step_s


def test_bloom_176b_is_predicted_within_15_percent_at_megatrons_calibration(capsys):
    # calibrated on Megatron-LM's 146B run (Selene), predicted on BigScience's run: another
    # framework (Megatron-DeepSpeed), another cluster, stages that do not divide the layers
    efficiency = validate("gpt-146b", SELENE)[0]["efficiency"]
    args = ["--layers", "70", "--hidden", "14336", "--heads", "112", "--seq", "2048", "--vocab", "250880"]
    args += ["--global-batch", "2048", "--gpus", "384", "--gpu", "a100", "--inter", "eth-100g", "--nics-per-node", "4"]
    args += ["--compute-efficiency", str(efficiency), "--json"]
    bloom = ["--tp", "4", "--pp", "12", "--micro-batch", "2", "--zero", "1"]
    code, out = _run(capsys, *args, *bloom, "--recompute", "full", "--sequence-parallel", "no")
    rows = json.loads(out.out)
    assert code == 0 and rows and all((r["tp"], r["pp"], r["micro_batch"]) == (4, 12, 2) for r in rows)
    assert all(r["recompute"] and not r["sequence_parallel"] for r in rows)
    assert rows[0]["tflops_per_gpu"] == pytest.approx(150, rel=0.15)
    code, out = _run(capsys, *args)  # and the planner's own choice is no slower
    assert code == 0 and json.loads(out.out)[0]["step_s"] <= rows[0]["step_s"]


def test_the_command_says_what_does_not_divide_where_no_layout_does(capsys):
    base = ["--model", "gpt-1.7b", "--global-batch", "512", "--gpus", "32"]
    for args, why in (
        (["--tp", "3"], "tp=3 does not divide the 32 GPUs"),
        (["--tp", "16", "--gpus", "64"], "tp=16 does not divide the 24 heads"),
        (["--pp", "64"], "tp=1 x pp=64 does not divide the 32 GPUs"),
        (["--pp", "32", "--tp", "1"], "pp=32 stages for 24 layers"),
        (["--pp", "2", "--chunks", "5"], "pp=2 x chunks=5 does not divide the 24 layers"),
        (["--pp", "1", "--chunks", "2"], "chunks=2 needs pipeline stages"),
        (
            ["--pp", "4", "--chunks", "2", "--micro-batch", "16", "--global-batch", "96"],
            "needs micro-batches a multiple",
        ),
        (["--global-batch", "500", "--micro-batch", "2", "--tp", "8", "--pp", "1"], "batch of 500 is not a multiple"),
    ):
        code, out = _run(capsys, *base, *args)
        assert code == 1 and "no layout divides" in out.out and why in out.out, (args, out.out)
        code, out = _run(capsys, *base, *args, "--json")
        assert code == 1 and json.loads(out.out) == [] and why in out.err, args


def _run(capsys, *args):
    code = main(list(args))
    return code, capsys.readouterr()


def test_the_command_ranks_layouts_as_json_best_first(capsys, tmp_path):
    base = ["--layers", "24", "--hidden", "2304", "--heads", "24", "--seq", "2048", "--vocab", "51200"]
    base += ["--global-batch", "512", "--gpus", "32", "--gpu", "a100", "--inter", "ib-hdr"]
    code, out = _run(capsys, *base, "--json", "--plot", str(tmp_path / "steps.svg"))
    rows = json.loads(out.out)
    assert code == 0 and rows and [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    for r in rows:
        assert {"dp", "tp", "pp", "micro_batch", "zero", "recompute", "memory_gb", "step_s", "tflops_per_gpu"} <= set(r)
        assert r["dp"] * r["tp"] * r["pp"] == 32 and r["memory_gb"] <= 78
        assert sum(r["time_parts_s"].values()) == pytest.approx(r["step_s"])
    svg = (tmp_path / "steps.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<rect") == 5 * min(10, len(rows)) + 5
    code, out = _run(capsys, *base, "--tp", "2", "--pp", "2", "--micro-batch", "2", "--json")
    fixed = json.loads(out.out)
    assert code == 0 and fixed and all((r["tp"], r["pp"], r["micro_batch"]) == (2, 2, 2) for r in fixed)
    # calibrated on a measured figure, the layout it was measured on predicts that figure
    every = ["--tp", "2", "--pp", "1", "--micro-batch", "4", "--zero", "1", "--recompute", "yes", "--chunks", "1"]
    every += ["--sequence-parallel", "yes"]
    code, out = _run(capsys, *base, *every, "--measured-tflops", "120", "--json")
    assert code == 0 and "compute efficiency" in out.err
    (row,) = json.loads(out.out)
    assert row["tflops_per_gpu"] == pytest.approx(120, abs=0.01)
    code, out = _run(capsys, "--model", "gpt-1.7b", "--global-batch", "512", "--gpus", "32", "--tp", "2")
    assert code == 0 and "GPT of 1.65B parameters" in out.out


def test_the_command_takes_a_tuning_tables_measured_node_path(capsys, tmp_path):
    table = tmp_path / "t.json"
    paths = [{"size": 2, "alpha": 1e-3, "beta": 1e8}, {"size": 8, "alpha": 2e-5, "beta": 2e9}]
    table.write_text(json.dumps({"tables": [], "node_paths": paths}))
    base = ["--model", "gpt-1.7b", "--global-batch", "64", "--gpus", "8", "--tp", "8", "--micro-batch", "1", "--json"]
    rows = {}
    for intra in (str(table), "latency=20us,bandwidth=2GB/s", "nvlink3"):  # the 8-rank entry, by hand, a preset
        code, out = _run(capsys, *base, "--intra", intra)
        assert code == 0
        rows[intra] = json.loads(out.out)
    steps = {k: [r["step_s"] for r in v] for k, v in rows.items()}
    assert steps[str(table)] == pytest.approx(steps["latency=20us,bandwidth=2GB/s"], rel=1e-12)
    assert steps[str(table)] != pytest.approx(steps["nvlink3"], rel=0.01)


def test_the_command_takes_a_node_reports_link_and_refuses_bad_input(capsys, tmp_path):
    report = tmp_path / "report.json"
    report.write_text(
        json.dumps({"pipeline": [{"grid": "1x4x1", "tp_models": {"allreduce": {"alpha_s": 6e-5, "beta_Bps": 1e9}}}]})
    )
    (tmp_path / "list.json").write_text("[1, 2]")
    base = ["--model", "gpt-1.7b", "--global-batch", "64", "--gpus", "8", "--json"]
    code, out = _run(capsys, *base, "--intra", str(report))
    assert code == 0 and json.loads(out.out)
    assert link_from_allreduce(AlphaBeta(6e-5, 1e9), 4) == AlphaBeta(pytest.approx(1e-5), pytest.approx(1.5e9))
    for args, why in (
        (["--gpus", "0"], "must be positive"),
        (["--inter", "token-ring"], "expected one of"),
        (["--intra", str(tmp_path / "none.json")], "No such file"),
        (["--measured-tflops", "100"], "needs the measured layout"),
        (["--intra", str(tmp_path / "list.json")], "holds no measured allreduce"),
        (["--hidden", "2300"], "not a multiple of heads"),
        (["--compute-efficiency", "0"], "--compute-efficiency 0: must lie in (0, 1]"),
        (["--compute-efficiency", "1.5"], "--compute-efficiency 1.5: must lie in (0, 1]"),
        (["--compute-efficiency", "nan"], "--compute-efficiency nan: must lie in (0, 1]"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(base + args)
        assert exc.value.code == 2
        assert why in capsys.readouterr().err, args
    code, out = _run(capsys, "--model", "gpt-1t", "--global-batch", "64", "--gpus", "8")
    assert code == 1 and "no layout fits" in out.out and "refused" in out.out and "out of memory" in out.out
    # where none fits: the fastest refused, and the one needing the least memory, with its figure
    _, refused = plan(MODELS["gpt-1t"], 64, replace(SELENE, gpus=8))
    least = min((e for e in refused if "out of memory" in e.refused), key=lambda e: sum(e.memory.values()))
    lines = out.out.splitlines()
    closest = [line for line in lines if line.startswith("closest to fitting")]
    assert len(closest) == 1 and least.refused in closest[0] and f"pp={least.layout.pp} " in closest[0], closest
    assert len([line for line in lines if line.startswith("refused")]) == 5 - (least in refused[:5])
    # with --json: the empty list on stdout, the same reasons on stderr
    code, out = _run(capsys, "--model", "gpt-1t", "--global-batch", "64", "--gpus", "8", "--json")
    assert code == 1 and json.loads(out.out) == [] and "no layout fits" in out.err and closest[0] in out.err
    # refused for the bubble alone (one sequence for 16 GPUs): nothing is closest in memory
    code, out = _run(capsys, "--model", "gpt-1.7b", "--global-batch", "1", "--gpus", "16")
    assert code == 1 and "bubble" in out.out and "closest to fitting" not in out.out and "out of memory" not in out.out


def test_a_processor_core_fits_back_to_the_rate_and_overhead_it_ran_at():
    from hpcdl.plan import GPU, fit_compute, layer_pass

    model = GPT(layers=4, hidden=128, heads=4, seq=64, vocab=256)
    core = GPU(name="core", peak=25e9, memory=24e9, hbm=20e9, intra="-", overhead=5e-4)
    points = [(b, t, 3 * layer_pass(model, b, t, core, 1.0)) for b, t in ((1, 1), (4, 2), (16, 4), (16, 1))]
    got = fit_compute(model, replace(core, peak=1.0, overhead=0.0), points)
    assert got.peak == pytest.approx(25e9, rel=1e-9) and got.overhead == pytest.approx(5e-4, rel=1e-9)
    assert got.hbm == core.hbm  # taken as given
    with pytest.raises(ValueError, match="two or more sizes"):
        fit_compute(model, core, points[:1] * 3)


def test_ranks_that_share_cores_and_each_calls_overhead_enter_the_parts_they_belong_to():
    from hpcdl.plan import GPU, layer_pass

    model = GPT(layers=4, hidden=128, heads=4, seq=64, vocab=256)
    core = GPU(name="core", peak=25e9, memory=24e9, hbm=20e9, intra="-", overhead=5e-4)
    link = AlphaBeta(1e-5, 2e9)
    base = Cluster(gpus=4, gpu=core, gpus_per_node=4, intra=link, inter=link, nics_per_node=4, efficiency=1.0, word=4)
    assert base.share() == 1.0
    shared = replace(base, cores_per_node=2, call_overhead=1.5e-3)
    assert shared.share() == 2.0 and replace(base, cores_per_node=8).share() == 1.0
    assert replace(base, gpus=2, cores_per_node=1).share() == 2.0  # two ranks on the node, one core
    assert replace(shared, contention=1.25).share() == 2.5 and replace(base, contention=1.1).share() == 1.1
    c = shared.call_overhead
    for dp, tp, pp, calls in ((2, 2, 1, 4 * 4 + 1 + 3 + 1), (1, 2, 2, 2 * 4 + 1 + 3), (2, 1, 2, 0), (1, 4, 1, 21)):
        lay = Layout(dp=dp, tp=tp, pp=pp, micro_batch=4, zero=0, recompute=False)
        a, b = estimate(model, 32 * dp, lay, base), estimate(model, 32 * dp, lay, shared)
        m = a.micro_batches
        assert b.time["compute"] == pytest.approx(2 * a.time["compute"])
        assert b.time["tp_comm"] - a.time["tp_comm"] == pytest.approx(m * calls * c)
        assert b.time["pp_comm"] - a.time["pp_comm"] == pytest.approx(m * 2 * c if pp > 1 else 0.0)
        assert b.time["dp_comm"] - a.time["dp_comm"] == pytest.approx(c if dp > 1 else 0.0)
        # the bubble: p - 1 times the last stage's time, its calls each paying c more; the
        # stages idle in the fill and drain leave their cores to it: contention, not the share
        layers = model.layers // pp * 3 * layer_pass(model, 4, tp, core, 1.0)
        layers += 6 * 4 * 64 * 128 * 256 / tp / core.peak  # the last stage's logits
        assert a.time["bubble"] == pytest.approx((pp - 1) * (layers + (a.time["tp_comm"] + a.time["pp_comm"]) / m))
        assert b.time["bubble"] - a.time["bubble"] == pytest.approx((pp - 1) * (calls * c + 2 * c))
        hot = estimate(model, 32 * dp, lay, replace(shared, contention=1.25))
        assert hot.time["bubble"] - b.time["bubble"] == pytest.approx((pp - 1) * 0.25 * layers)
        assert hot.time["compute"] == pytest.approx(1.25 * b.time["compute"])
    # gradients in fp32 move twice the bytes of mixed precision: a link of bandwidth alone
    wide = replace(base, intra=AlphaBeta(0.0, 1e9), inter=AlphaBeta(0.0, 1e9))
    lay = Layout(dp=4, tp=1, pp=1, micro_batch=4, zero=0, recompute=False)
    half = estimate(model, 128, lay, replace(wide, word=2)).time["dp_comm"]
    assert estimate(model, 128, lay, wide).time["dp_comm"] == pytest.approx(2 * half)
    for bad, text in (
        ({"word": 3}, "word=3"),
        ({"cores_per_node": 0}, "cores_per_node=0"),
        ({"call_overhead": -1}, "call_overhead=-1"),
        ({"contention": 0.5}, "contention=0.5"),
    ):
        with pytest.raises(ValueError, match=text):
            replace(base, **bad)


def test_sequence_parallelism_and_selective_recomputation_keep_what_korthikanti_et_al_count():
    m, t, b = MODELS["gpt3-175b"], 8, 2
    s, h, a, layers = m.seq, m.hidden, m.heads, m.layers
    cl = replace(SELENE, gpus=8)
    logits = 2 * 4 * s * b * m.vocab / t
    scores = 5 * a * s * s * b / t
    kept = {  # per layer, and one layer's worth to recompute in (table 2 of the paper)
        ("none", False): (s * b * h * (10 + 24 / t) + scores, 0),
        ("none", True): (s * b * h * 34 / t + scores, 0),
        ("selective", False): (s * b * h * (10 + 24 / t), scores),
        ("selective", True): (s * b * h * 34 / t, scores),
        ("full", False): (2 * s * b * h, s * b * h * (10 + 24 / t) + scores),
        ("full", True): (2 * s * b * h / t, s * b * h * 34 / t + scores),
    }
    for (way, sp), (per_layer, working) in kept.items():
        lay = Layout(dp=1, tp=t, pp=1, micro_batch=b, recompute=way == "full", selective=way == "selective")
        lay = replace(lay, sequence_parallel=sp)
        got = estimate(m, b, lay, cl).memory["activations"]
        assert got == pytest.approx(layers * per_layer + working + logits, rel=1e-12), (way, sp)
    with pytest.raises(ValueError, match="exclude each other"):
        Layout(dp=1, tp=8, pp=1, micro_batch=1, recompute=True, selective=True)
    with pytest.raises(ValueError, match="needs tp > 1"):
        Layout(dp=8, tp=1, pp=1, micro_batch=1, sequence_parallel=True)


def test_sequence_parallelism_and_selective_recomputation_cost_what_they_repeat_and_split():
    m, t, b = MODELS["gpt-22b"], 8, 4
    layers = m.layers
    cl = replace(SELENE, gpus=8, efficiency=0.6, call_overhead=1e-5)
    base = Layout(dp=1, tp=t, pp=1, micro_batch=b, recompute=False)
    est = {
        (way, sp): estimate(
            m, 4 * b, replace(base, recompute=way == "full", selective=way == "selective", sequence_parallel=sp), cl
        )
        for way in ("none", "selective", "full")
        for sp in (False, True)
    }
    n = 4  # micro-batches
    core = attention_core_pass(m, b, t, cl.gpu, 0.6)
    assert core == pytest.approx(
        4 * b * m.seq**2 * m.hidden / t / (0.6 * cl.gpu.peak) + 9 * b * m.heads * m.seq**2 / t / 2e12
    )
    # selective repeats the attention core in every layer's backward; full, the whole forward
    diff = est["selective", False].time["compute"] - est["none", False].time["compute"]
    assert diff == pytest.approx(n * layers * core, rel=1e-9)
    diff = est["full", False].time["compute"] - est["none", False].time["compute"]
    assert diff == pytest.approx(n * layers * layer_pass(m, b, t, cl.gpu, 0.6), rel=1e-9)
    # along the sequence, the norms, dropouts and residual adds (24 bytes a token and width) split over tp
    split = 3 * 24 * b * m.seq * m.hidden * (1 - 1 / t) / cl.gpu.hbm
    diff = est["none", False].time["compute"] - est["none", True].time["compute"]
    assert diff == pytest.approx(n * layers * split, rel=1e-9)
    # an allreduce's bytes more a layer (the backward's gathers), each in two calls
    ar = ring_allreduce(cl.intra, t, 2 * b * m.seq * m.hidden)
    c = cl.call_overhead
    for way, calls in (("none", 4), ("selective", 4), ("full", 6)):
        diff = est[way, True].time["tp_comm"] - est[way, False].time["tp_comm"]
        assert diff == pytest.approx(n * layers * (ar + (calls + 1) * 2 * c - calls * c), rel=1e-9), way
    full = est["full", False].time["tp_comm"] - est["none", False].time["tp_comm"]
    assert full == pytest.approx(n * layers * 2 * (ar + c), rel=1e-9)
    # FLOPs per second as Megatron-LM counts them: the recomputed forward, not the recomputed attention
    for (way, _), e in est.items():
        flops = m.flops(4 * b, way == "full")
        assert e.tflops_per_gpu == pytest.approx(flops / e.step_s / 8 / 1e12, rel=1e-9)


def test_ranks_are_placed_as_megatron_places_them_and_straddling_groups_talk_over_the_ports():
    # tensor-parallel fastest, then data-parallel, then the pipeline's stages (hpcdl.parallel.Grid's order)
    m = MODELS["gpt-146b"]
    cl = replace(SELENE, gpus=48)
    ports = replace(cl, intra=cl.inter_per_gpu())
    for tp, pp, straddles in ((6, 8, True), (8, 6, False), (4, 12, False), (4, 3, False), (3, 2, True)):
        lay = Layout(dp=48 // (tp * pp), tp=tp, pp=pp, micro_batch=1)
        here, there = estimate(m, 96, lay, cl).time, estimate(m, 96, lay, ports).time
        assert (here["tp_comm"] == there["tp_comm"]) is straddles, (tp, pp)
        assert here["pp_comm"] == there["pp_comm"], (tp, pp)  # stages tp x dp ranks apart: never one node here
    # on 16 GPUs, nodes of 8: a replica's neighbours are tp ranks apart, its stages tp x dp
    cl = replace(SELENE, gpus=16)
    slow = replace(cl, inter=AlphaBeta(1e-3, 1e6))
    for (dp, tp, pp), inside in {(4, 2, 2): ("tp", "dp"), (4, 4, 1): ("tp",), (2, 2, 4): ("tp", "dp")}.items():
        lay = Layout(dp=dp, tp=tp, pp=pp, micro_batch=1, zero=1)
        fast, late = estimate(m, 64, lay, cl).time, estimate(m, 64, lay, slow).time
        for part in ("tp", "dp", "pp"):
            if (part == "pp" and pp == 1) or (part == "tp" and tp == 1):
                continue
            assert (fast[f"{part}_comm"] == late[f"{part}_comm"]) is (part in inside), (dp, tp, pp, part)
    # a whole job on one node talks inside it, even where its groups do not divide the node's GPUs
    for gpus, (dp, tp, pp) in ((8, (2, 2, 2)), (6, (1, 3, 2))):
        one = replace(SELENE, gpus=gpus)
        lay = Layout(dp=dp, tp=tp, pp=pp, micro_batch=1)
        assert estimate(m, 64, lay, one).time == estimate(m, 64, lay, replace(one, inter=AlphaBeta(1e-3, 1e6))).time
    # stages that straddle nodes split their data-parallel groups: 48 GPUs, tp=2, dp=3, pp=8 on
    # nodes of 8; the second stage's ranks 6-11 hold the group 6, 8, 10 on two nodes
    assert placement(2, 3, 8, 8) == Placement(tp_inside=True, dp_per_node=1, pp_inside=False)
    assert placement(4, 8, 12, 8).dp_per_node == 2 and placement(2, 4, 1, 8).dp_per_node == 4
    assert placement(3, 1, 2, 8) == Placement(tp_inside=True, dp_per_node=1, pp_inside=True)
    lay = Layout(dp=3, tp=2, pp=8, micro_batch=1, zero=1)
    cl = replace(SELENE, gpus=48)
    slow = replace(cl, inter=AlphaBeta(1e-3, 1e6))
    assert estimate(m, 48, lay, cl).time["dp_comm"] < estimate(m, 48, lay, slow).time["dp_comm"]


def test_calibrated_on_megatrons_gpt3_with_selective_recomputation_it_predicts_the_other_runs():
    rows = validate_recomputation("gpt3-175b", SELENE)
    assert [(r["model"], r["recompute"]) for r in rows] == [
        (name, way) for name, *_ in MEGATRON_RECOMPUTATION for way in ("full", "selective")
    ]
    for r in rows:
        assert abs(r["error"]) < 0.15, r
        assert r["layout"]["refused"] is None and r["layout"]["sequence_parallel"] is (r["recompute"] == "selective")
    assert rows[3]["error"] == pytest.approx(0, abs=1e-6)
    # what selective recomputation and sequence parallelism gain: within 6 % of what was measured
    for full, selective in zip(rows[::2], rows[1::2], strict=True):
        published = full["published_step_s"] / selective["published_step_s"]
        assert full["predicted_step_s"] / selective["predicted_step_s"] == pytest.approx(published, rel=0.06)
    # without either, the three large runs do not fit: why they recomputed everything before
    for name, tp, pp, gpus, batch, *_ in MEGATRON_RECOMPUTATION[1:]:
        ok, refused = plan(
            MODELS[name],
            batch,
            replace(SELENE, gpus=gpus),
            tp=tp,
            pp=pp,
            zero=0,
            recompute="none",
            sequence_parallel=False,
        )
        assert not ok and refused and all("out of memory" in e.refused for e in refused), name
    with pytest.raises(ValueError, match="anchor 'gpt-146b'"):
        validate_recomputation("gpt-146b", SELENE)


def test_the_command_fixes_recomputation_and_sequence_parallelism(capsys):
    base = ["--model", "gpt3-175b", "--global-batch", "512", "--gpus", "64", "--json"]
    code, out = _run(capsys, *base)
    rows = json.loads(out.out)
    assert code == 0 and {(r["recompute"], r["selective"]) for r in rows} == {
        (True, False),
        (False, True),
        (False, False),
    }
    assert not any(r["sequence_parallel"] for r in rows if r["tp"] == 1)
    assert {r["sequence_parallel"] for r in rows if r["tp"] > 1} == {True, False}  # with a slow link it can lose
    code, out = _run(capsys, *base, "--recompute", "selective", "--sequence-parallel", "no")
    rows = json.loads(out.out)
    assert (
        code == 0 and rows and all(r["selective"] and not r["recompute"] and not r["sequence_parallel"] for r in rows)
    )
    for word in ("yes", "full"):
        code, out = _run(capsys, *base, "--recompute", word, "--tp", "8")
        assert code == 0 and all(r["recompute"] and not r["selective"] for r in json.loads(out.out))
    code, out = _run(capsys, *base[:-1], "--tp", "8", "--pp", "8")
    head = out.out.splitlines()[1].split()
    assert code == 0 and head[6:8] == ["recompute", "sp"]
    code, out = _run(capsys, "--validate-recompute")
    lines = out.out.splitlines()
    assert code == 0 and "calibrated on gpt3-175b" in lines[0] and len(lines) == 2 + 2 * len(MEGATRON_RECOMPUTATION)
    with pytest.raises(SystemExit) as exc:
        main(["--validate-recompute", "gpt-2"])
    assert exc.value.code == 2 and "anchor 'gpt-2'" in capsys.readouterr().err
    # where the tensor-parallel link is slow, sequence parallelism's extra gathers lose: the rows without it win
    code, out = _run(capsys, *base[:-1], "--gpus", "128", "--tp", "16", "--pp", "8", "--recompute", "full", "--json")
    rows = json.loads(out.out)
    assert code == 0 and not rows[0]["sequence_parallel"] and any(r["sequence_parallel"] for r in rows)
    code, out = _run(
        capsys, "--model", "gpt-1.7b", "--global-batch", "64", "--gpus", "8", "--recompute", "none", "--json"
    )
    assert code == 0 and not any(r["recompute"] or r["selective"] for r in json.loads(out.out))
    for args, why in (
        (["--pp", "-1"], "--pp -1: must be at least 1"),
        (["--top", "0", "--plot", "x.svg"], "--top 0: must be at least 1"),
        (["--chunks", "-1"], "--chunks -1: must be at least 1"),
        (["--micro-batch", "0"], "--micro-batch 0: must be at least 1"),
        (["--tp", "1", "--sequence-parallel", "yes"], "needs --tp > 1"),
        (["--validate", "--validate-recompute"], "one at a time"),
        (
            ["--measured-tflops", "100", "--tp", "8", "--pp", "1", "--micro-batch", "1", "--recompute", "selective",
             "--attention", "flash"],
            "repeats nothing with flash attention",
        ),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            main([*base, *args])
        assert exc.value.code == 2 and why in capsys.readouterr().err, args


def test_the_command_gives_the_days_to_train_on_the_tokens_asked(capsys):
    base = ["--model", "gpt3-175b", "--global-batch", "1536", "--gpus", "1024", "--recompute", "full"]
    code, out = _run(capsys, *base, "--tokens", "300e9", "--json")
    rows = json.loads(out.out)
    assert code == 0 and rows
    for r in rows:  # 300e9 tokens are 95367 steps of 1536 sequences of 2048 tokens
        assert r["train_days"] == pytest.approx(95367.4 * r["step_s"] / 86400, rel=1e-3)
    code, out = _run(capsys, *base, "--tokens", "600e9", "--json")
    assert [r["train_days"] for r in json.loads(out.out)] == pytest.approx(
        [2 * r["train_days"] for r in rows], rel=1e-3
    )
    code, out = _run(capsys, *base, "--tokens", "300e9", "--top", "2")
    lines = out.out.splitlines()
    days = lines[1].split().index("days") - 2  # after "mem GB" and "step s", two words a column
    assert code == 0 and float(lines[2].split()[days]) == pytest.approx(rows[0]["train_days"], abs=0.06)
    code, out = _run(capsys, *base, "--json")
    assert "train_days" not in json.loads(out.out)[0]
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit) as exc:
            main([*base, "--tokens", bad])
        assert exc.value.code == 2 and "must be a finite positive number" in capsys.readouterr().err


def test_flash_attention_keeps_no_scores_skips_the_masked_half_and_computes_them_again_in_the_backward(capsys):
    m, t, b = replace(MODELS["gpt-22b"], seq=8192), 8, 1
    s, h, a = m.seq, m.hidden, m.heads
    cl = replace(SELENE, gpus=8, efficiency=0.6)
    rate, hbm, n = 0.6 * cl.gpu.peak, cl.gpu.hbm, 4
    scores_bytes = 9 * b * a * s * s / t  # what plain attention moves through memory a forward
    for recompute, passes in ((False, 3), (True, 4)):
        lay = Layout(dp=1, tp=t, pp=1, micro_batch=b, recompute=recompute, sequence_parallel=True)
        plain, flash = (estimate(m, n * b, replace(lay, flash_attention=f), cl) for f in (False, True))
        # the causal mask's hidden half of the core's 4 b s² h FLOPs skipped in every pass, and
        # the backward's second QK^T (its unmasked half)
        skipped, again = 2 * b * s * s * h / t / rate, b * s * s * h / t / rate
        diff = flash.time["compute"] - plain.time["compute"]
        assert diff == pytest.approx(n * m.layers * (again - passes * (skipped + scores_bytes / hbm)), rel=1e-9)
        stats = 4 * a * s * b / t  # fp32 softmax statistics a row and head, in place of 5 a s² b / tp
        kept = flash.memory["activations"] - plain.memory["activations"]
        layers = 1 if recompute else m.layers  # the scores live in one layer's recomputation, or in every one
        assert kept == pytest.approx(layers * (stats - 5 * a * s * s * b / t), rel=1e-9)
        assert flash.tflops_per_gpu == pytest.approx(m.flops(n * b, recompute) / flash.step_s / 8 / 1e12)
    with pytest.raises(ValueError, match="repeats nothing with flash attention"):
        Layout(dp=1, tp=8, pp=1, micro_batch=1, recompute=False, selective=True, flash_attention=True)
    # at 8192 tokens plain attention only fits recomputing, flash attention without
    base = ["--model", "gpt-22b", "--seq", "8192", "--global-batch", "16", "--gpus", "8", "--json"]
    code, out = _run(capsys, *base)
    plain = json.loads(out.out)
    code2, out = _run(capsys, *base, "--attention", "flash")
    flash = json.loads(out.out)
    assert code == code2 == 0 and not any(r["flash_attention"] for r in plain)
    assert all(r["flash_attention"] and not r["selective"] for r in flash)
    assert all(r["recompute"] or r["selective"] for r in plain) and not flash[0]["recompute"]
    assert flash[0]["step_s"] < plain[0]["step_s"]
    code, out = _run(capsys, *base, "--attention", "flash", "--recompute", "selective")
    assert code == 1 and json.loads(out.out) == [] and "repeats nothing with flash attention" in out.err
