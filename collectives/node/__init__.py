"""The node engine: collectives among the ranks of one node through shared memory (the
``shm`` algorithm).

- :mod:`.channel`: the node channel, one MPI-3 shared window per node with its counters,
  slots and chunk buffers, and the waits on them (spinning, then sleeping on a futex);
  ``cslots.c`` is the compiled twin of its wait-and-copy loop.
- :mod:`.futex`: sleeping until a word of shared memory changes.
- :mod:`.arena`: arrays that live in the node's window, so peers read them in place.
- :mod:`.onestep`: a small call finished in one step from the channel's slots, with as
  little Python as possible; :mod:`.slots` holds the step functions it runs.
- :mod:`.staged`: larger calls streamed through the channel's buffers in chunks.
- :mod:`.inplace`: calls whose every buffer lies in the node's arena, read where they lie.
"""
