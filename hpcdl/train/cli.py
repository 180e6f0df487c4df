"""``python -m hpcdl.train`` / ``hpcdl-train``: parse, build, run, clean up."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _say_once(text: str) -> None:
    """Print on world rank 0 only (MPI is initialized when hpcdl is imported)."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        print(text, file=sys.stderr, flush=True)


def _dry_run(cfg) -> None:
    import hpcdl as hvd

    from .launch import launcher, pick_device, rank_placement, servers
    from .loop import build_grid, init_runtime

    init_runtime(cfg)
    ranks = rank_placement(hvd, pick_device(cfg.training.device, hvd.local_rank()))
    grid = build_grid(cfg)  # a RunError, on every rank, when it does not fit the world
    coords = hvd.allgather_object((grid.dp_rank, grid.tp_rank, grid.pp_rank) if grid else (hvd.rank(), 0, 0))
    if hvd.rank() == 0:
        print("# resolved configuration")
        print(json.dumps(cfg.to_dict(), indent=1))
        print(f"# rank layout: {hvd.size()} ranks on {len({r['host'] for r in ranks})} node(s), launcher {launcher()}")
        dp, tp, pp = (grid.dp, grid.tp, grid.pp) if grid else (hvd.size(), 1, 1)
        print(f"# grid: dp {dp} x tp {tp} x pp {pp} (tp fastest: a tensor-parallel group is consecutive ranks)")
        print(f"{'rank':>5} {'local':>6} {'node':>5}  {'dp':>3} {'tp':>3} {'pp':>3}  {'device':<7} host (pid)")
        for r, (d, t, p) in zip(ranks, coords, strict=True):
            print(
                f"{r['rank']:>5} {r['local_rank']:>4}/{r['local_size']:<1} {r['node']:>5}  {d:>3} {t:>3} {p:>3}  "
                f"{r['device']:<7} {r['host']} ({r['pid']})"
            )
        for srv in servers(hvd).get("servers", []):
            print(f"{srv['rank']:>5} parameter server          {'':<7} {srv['host']} ({srv['pid']})")
    if grid:
        grid.close()
    hvd.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    from collectives.cli import run_main
    from hpcdl.startup import ignore_signals_while_ending, signal_while_starting

    from .config import ConfigError, parse_config

    try:
        cfg = parse_config(argv)
    except ConfigError as exc:  # the same on every rank: each exits, none has started work
        _say_once(f"hpcdl.train: error: {exc} (see python -m hpcdl.train --help)")
        return 2
    if cfg.job.dry_run:

        def dry_run() -> int:
            import hpcdl as hvd

            from .config import RunError

            try:
                try:
                    _dry_run(cfg)
                finally:  # settled: the rank only shuts down from here
                    ignore_signals_while_ending()
            except RunError as exc:  # every rank raises it alike
                _say_once(f"hpcdl.train: error: {exc}")
                hvd.shutdown()
                return 2
            if signal_while_starting() is not None:  # a Ctrl-C noted while it ran
                _say_once("hpcdl.train: interrupted")
                return 130
            return 0

        return run_main(dry_run)

    def train() -> int:
        import hpcdl as hvd

        from .config import Interrupted, RunError
        from .loop import run

        try:
            try:
                summary = run(cfg)
            finally:  # settled (a signal after the last step is moot): the rank only shuts down from here
                ignore_signals_while_ending()
        except RunError as exc:  # every rank raises it alike: say it once and end with status 2
            _say_once(f"hpcdl.train: error: {exc}")
            hvd.shutdown()
            return 2
        except Interrupted as exc:  # SIGINT or SIGTERM: 130 or 143, as a shell reports them
            if exc.apart:  # ssp and async workers stop each at its own step: end the job from here
                from mpi4py import MPI

                print(f"hpcdl.train: {exc}", file=sys.stderr, flush=True)
                MPI.COMM_WORLD.Abort(exc.code)
            _say_once(f"hpcdl.train: {exc}")
            hvd.shutdown()
            return exc.code
        if hvd.rank() == 0:
            final = ", ".join(f"{k} {v:.4f}" for k, v in summary["final"].items())
            steps = f"{summary['steps']} steps"
            if summary["resumed_from_step"] is not None:  # this job's figures only
                first = summary["resumed_from_step"]
                steps = f"resumed from step {first}; {summary['steps_this_job']} steps ({first + 1}-{summary['steps']})"
            print(
                f"hpcdl.train: {steps} on {summary['world_size']} ranks "
                f"({summary['device']}, {summary['precision']}) in "
                f"{summary['wall_time_s']:.1f} s ({summary['samples_per_s']:.0f} samples/s); held-out {final}; "
                f"run directory {summary['run_dir']}",
                flush=True,
            )
        hvd.shutdown()
        return 0

    return run_main(train)


def console_main() -> None:
    sys.exit(main())
