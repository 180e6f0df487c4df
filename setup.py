"""Build hook for the optional compiled part of the node channel (``collectives.node.cslots``).

The package metadata lives in setup.cfg. The extension is optional: where it does not
build (no C compiler or Python headers), the install goes on and the pure-Python channel
loop is used.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "collectives.node.cslots",
            ["collectives/node/cslots.c"],
            optional=True,
            # IEEE operations exactly as written, so reductions give numpy's bits; -O3 turns
            # the reduction loops into vector instructions (element by element, the same
            # bits), which -O2's cheapest cost model leaves scalar where inputs may alias
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"],
            libraries=["m"],
        )
    ]
)
