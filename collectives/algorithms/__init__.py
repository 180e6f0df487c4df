"""The collective algorithms, each a schedule over a :class:`~collectives.transport.Transport`:
ring, binomial tree, recursive doubling and halving, Rabenseifner, hierarchical (inside a
node, then across nodes), pairwise-exchange alltoall, Adasum, the multi-node shared-memory
allreduce, and the MPI library's own calls (``native``) as a baseline and fallback.
:mod:`.blocks` holds the block partitions and the power-of-two fold they share.

An algorithm is a generator that posts nonblocking sends and receives and yields while
they are in flight; :mod:`collectives.select` registers them by name for ``algorithm=``
and ``auto``. None of them knows of the node channel or of device memory.
"""
