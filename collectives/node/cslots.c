/* The node channel's post/poll loop and one-step reductions, compiled.
 *
 * collectives.channel.Channel posts a call's signature words (and, for small calls, its
 * data) into its slot of the node's shared window, publishes its sequence number (in the
 * slot's header, then in its counter), waits for every peer's (a broadcast's, or a call's
 * of up to 16 bytes, in its header, whose line also holds the signature and such a payload:
 * the one line a tiny call needs from each peer), and finishes small calls from the slots.
 * In Python each of those steps costs a fraction of a microsecond, which is most of a small
 * collective. This module does the same steps on the same memory with the same protocol
 * (see channel.py's docstring), so a rank using it and a rank using the pure-Python loop
 * interoperate:
 *
 *   Core(me, seqs, sleeping, heads, slots, slot_bytes, spin, progress, contiguous, futex, aborts, stalled, dones,
 *        streams, takes, stores)
 *       seqs, sleeping, aborts, dones, streams, takes, stores: every rank's counter,
 *       sleeping-flag, abort-word, reduced-block counter, streamed-piece counter, taken-piece
 *       counter and measured-stores flag address (int64 words);
 *       heads, slots: every rank's slot 0 and slot 1 header and data addresses, as
 *       [r0p0, r0p1, r1p0, ...]; progress(): called while waiting; contiguous(x): a
 *       C-contiguous copy of x (numpy.ascontiguousarray); stalled(rank, want, kind): raises
 *       the error of a stall (kind 0: this rank waited core.stall seconds for `rank` to post
 *       call `want`; 4: to publish its reduced slice of call `want`; 5: to stream piece
 *       `want & (2**24 - 1)` of call `want >> 24`; 6: to take that piece of every peer; 1:
 *       `rank` gave up after a stall; 2: this rank gave up before).
 *   core.post(a, b, c, payload=None, win=0, wout=0) -> seq
 *   core.wait_posted(seq)
 *   core.exchange(a, b, c, payload=None, uneven=False, win=0, wout=0, nbytes=-1) -> seq or -seq
 *       (nbytes: the call's bytes a rank, where the caller knows them: up to HEADER_WAIT_BYTES
 *       it waits for the peers' posts on their slots' headers, as a step does: wait_posted)
 *   core.step(kind, ...) -> Step: one collective's one-step call for one dtype and shape,
 *       step(x, out=None) posts x, waits and finishes the call from the slots (below); an
 *       allreduce or reduce given `second` (split_at) finishes in two steps (each rank
 *       reduces its block into its slot at that byte offset, publishes `dones`, and every
 *       rank taking the result copies every rank's block); a broadcast given `second` (a
 *       piece) streams through the root's slot
 *   core.stream(seq, root, buf, piece, src=None): an agreed broadcast through the root's slot,
 *       or read from its memory (below)
 *   core.gather(seq, buf, offsets, piece, src=None): an agreed allgather through every rank's
 *       slot (below)
 *   core.single_copy(pids, nbytes, broadcasts), core.cma_read(pid, address, buf): allgathers
 *       from nbytes per rank, and broadcasts from `broadcasts`, read the sender's memory (below)
 *   core.segments(here, there, nbytes): every rank's segment of the node's arena, which those
 *       reads copy through where the sender's data lies there (below)
 *   core.reduce_scatter(seq, src, lo, hi, out, dtype, op, vote), core.allreduce(seq, src,
 *       out, dtype, op, vote): a reduce-scatter or allreduce read from the peers' memory
 *       where every rank votes for it (below)
 *   core.put(dst, src, total=None): a copy into shared memory (copy_shared: non-temporal
 *       stores from core.nontemporal bytes, as every copy into a slot here), or out of it
 *       into a message of `total` bytes (copy_out: from core.nontemporal_out)
 *   line_round_trip(buf, me, rounds, timeout): a module function, the round trip of one cache
 *       line between two processes sharing buf, the floor under every wait above (below)
 *
 * Loads and stores of the counters are atomic, and full fences order them around every
 * publication, as MPI_Win_sync does on the Python side. Reductions combine every rank's
 * data in rank order with plain IEEE operations (no contraction), so they give numpy's
 * bits: sum, prod and avg of every dtype here, min and max of the integers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if defined(__linux__)
#include <errno.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#define HAVE_FUTEX 1
#else
#define HAVE_FUTEX 0
#endif

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

/* Python's loop takes about this long per poll; the spin budgets are counted in its polls */
#define POLL_NS 75
/* the callback that progresses other work runs this often while waiting */
#define PROGRESS_NS 4000
/* the pure-Python loop's budget while the process has other work (channel.POLITE_SPIN) */
#define POLITE_SPIN 64
/* the longest one sleep lasts before the waiter looks again (channel._DOZE) */
#define DOZE_NS 1000000
/* a streams word holds seq << STREAM_SHIFT | pieces (channel.STREAM_SHIFT) */
#define STREAM_SHIFT 24
/* a cache line's bytes, to which a root's share of a single-copy broadcast is rounded */
#define LINE_BYTES 64
/* a slot's header: the signature words a, b, c, the arena words win, wout, and the call
 * that posted them, stored last (channel.HEAD_WORDS); a payload of up to HEAD_DATA bytes
 * follows on the same line (slot_data), a larger one in the slot's data, from the next line */
#define POSTED 5
#define HEAD_BYTES 48
#define HEAD_DATA (LINE_BYTES - HEAD_BYTES)

/* the wire codes of collectives.ops.DTYPES */
enum { F16 = 0, BF16 = 1, F32 = 2, F64 = 3, I8 = 4, I16 = 5, I32 = 6, I64 = 7, U8 = 8 };
/* the op codes taken by reduce */
enum { OP_SUM = 0, OP_AVG = 1, OP_MIN = 2, OP_MAX = 3, OP_PROD = 4 };

/* Measured stores of one kind of destination (Core.kinds; see copy_measured). */
typedef struct {
    double logs[3];   /* the last three probes' logs of a plain store's time over a non-temporal one's */
    double log_ratio; /* their median (their mean before the third) */
    int64_t probes;   /* probes made */
    int64_t due;      /* measured bytes still to copy before the next probe */
    int own;          /* this rank's own call, from its probes */
    int nt;           /* the choice: non-temporal from NONTEMPORAL_BYTES (this rank's or a peer's call) */
} Stores;

/* Which block a large allgather by single copy offers its peers' reads (single_copy_allgather),
 * by a cache line's round trip to its partner rank, timed now and then inside those calls. */
typedef struct {
    int64_t calls;      /* large allgathers so far, counted alike on every rank */
    int64_t checks;     /* round trips timed */
    double trip_ns;     /* the last one, a round trip's ns (0: none yet) */
    int block;          /* offer its own block of the output, copied in first (else its source) */
} Offers;

#define SLOTS 0  /* a call's slots: data a peer copies out at once */
#define STAGED 1 /* the chunk buffers a chunked call stages its input through (Core.put) */
#define KINDS 2

typedef struct {
    PyObject_HEAD int n, me;
    int64_t **seqs;     /* n */
    int64_t **sleeping; /* n */
    int64_t **aborts;   /* n: nonzero once the rank gave up after a stall */
    int64_t **dones;    /* n: the last call whose reduced block the rank published (split allreduces) */
    int64_t **streams;  /* n: seq << STREAM_SHIFT | pieces the rank has streamed in or out (broadcasts) */
    int64_t **takes;    /* n: seq << STREAM_SHIFT | rounds of its peers' pieces the rank has copied out (allgathers) */
    int64_t **stores;   /* n: bit k set while the rank's measured stores of kind k call for non-temporal ones */
    int64_t stall_ns;   /* a wait for one peer ends in a stall error after this long (0: never) */
    PyObject *stalled;  /* raises the stall's error */
    int64_t **heads;    /* 2n: rank r, slot p at 2r + p */
    char **slots;       /* 2n */
    Py_ssize_t slot_bytes;
    Py_ssize_t nt_bytes;     /* copies into shared memory from this many bytes use non-temporal stores (0: never) */
    Py_ssize_t nt_bcast;     /* and a broadcast root's (0: never) */
    Py_ssize_t out_nt_bytes; /* and copies out of it, into messages of this many bytes (0: never) */
    int measured;            /* copies into shared memory below nt_bytes choose their stores by measurement */
    Stores kinds[KINDS];     /* the measured stores of each kind of destination (copy_measured) */
    Offers offers;           /* which block a large allgather by single copy offers (single_copy_allgather) */
    Py_ssize_t cma_bytes;    /* allgathers from this many bytes per rank read the sender's memory (0: never) */
    Py_ssize_t cma_bcast;    /* and broadcasts (0: never) */
    Py_ssize_t *pids;        /* n: every rank's process id (cross-memory attach) */
    char **seg_here;         /* n: where each rank's segment of the node's arena is mapped here (core.segments) */
    uintptr_t *seg_there;    /* n: and where it lies in that rank's own process */
    Py_ssize_t seg_bytes;    /* the segments' size (0: none known) */
    int64_t mapped_bytes;    /* bytes a move with a peer copied through its segment's mapping */
    int64_t waits[4];        /* waits that found a peer behind, their polls and sleeps, wake-ups sent (core.waits) */
    char *scratch;           /* the peers' pieces a reduce-scatter read by single copy reduces */
    Py_ssize_t scratch_bytes;
    long spin;
    int futex;
    PyObject *progress;
    PyObject *contiguous;
    PyObject *polite; /* None or a callable */
} Core;

static inline void fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline int64_t load(int64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void store(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void wake_sleepers(Core *c, int64_t *addr) {
#if HAVE_FUTEX
    if (!c->futex)
        return;
    fence(); /* the store just made before the loads below */
    for (int r = 0; r < c->n; r++) {
        if (r != c->me && load(c->sleeping[r])) {
            syscall(SYS_futex, (void *)addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
            c->waits[3]++;
            break;
        }
    }
#else
    (void)c;
    (void)addr;
#endif
}

/* Publish v in this rank's counter *w: after a fence (what the counter announces is in
 * memory first), then wake the peers that may sleep on it. */
/* Copy len bytes with non-temporal stores: they go to memory past this core's caches and
 * drop the line from every cache that holds it. The closing sfence orders them before the
 * word that publishes them. */
static void copy_nt(char *dst, const char *src, size_t len) {
#ifdef __SSE2__
    size_t head = (size_t)(-(uintptr_t)dst & 15);
    head = head < len ? head : len;
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= len; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i e = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i f = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), e);
        _mm_stream_si128((__m128i *)(dst + i + 48), f);
    }
    memcpy(dst + i, src + i, len - i);
    _mm_sfence();
#else
    memcpy(dst, src, len);
#endif
}

#if defined(__x86_64__) || defined(__i386__)
static inline uint64_t ticks(void) { return __builtin_ia32_rdtsc(); }
#else
static inline uint64_t ticks(void) { return (uint64_t)now_ns(); }
#endif

/* Measured stores. Where the node's caches do not say whether its ranks share a last-level
 * cache (a VM may move its virtual CPUs between cores that do and cores that do not), each
 * rank measures its own copies into shared memory, for each kind of destination apart: a
 * call's slots (SLOTS) and the chunk buffers a chunked call stages through (STAGED). Once
 * per PROBE_PLAIN bytes of copies of at least 2 * PROBE_BYTES of a kind (PROBE_NT while it
 * uses non-temporal stores, where the plain half of a probe is the slow one), it writes a
 * copy's first PROBE_BYTES with plain stores and the next with non-temporal ones (the other
 * order every other time), timed. The median ratio of the two times over the kind's last
 * three probes chooses the stores of its copies from NONTEMPORAL_BYTES: non-temporal once
 * plain ones take NT_ABOVE times as long, plain again below PLAIN_BELOW. On the 2-vCPU
 * reference VM, 16 KiB of plain stores into slot lines a peer read took 5-23 times as long
 * as non-temporal ones on one of the ranks while its cores shared no cache, and 0.5-3 times
 * while they did, where plain stores leave the data in the cache the peer reads it from;
 * into the chunk buffers, 2.2-5.7 times against 0.4-1.7, and there non-temporal stores
 * took a 16 MiB allreduce from 8000-10000 to 5500-6400 us where the cores shared no cache,
 * and from 2500-2700 to 2700-2900 where they did. The stores change only the time a copy
 * takes, never its bytes. */
#define PROBE_BYTES (16 << 10)
#define PROBE_PLAIN (1 << 20)
#define PROBE_NT (4 << 20)
#define NONTEMPORAL_BYTES 4096
static const double NT_ABOVE[KINDS] = {5.0, 2.0};
static const double PLAIN_BELOW[KINDS] = {3.5, 1.6};

/* One probe's times (ticks) of PROBE_BYTES of plain and of non-temporal stores into a
 * destination of `kind`: taken into the kind's median, this rank's calls published in its
 * stores word (bit `kind`), and each kind's choice taken from every rank's word: every
 * rank takes non-temporal stores while any calls for them, since a rank whose own plain
 * stores measure no slower (the cores' traffic need not be symmetric) still writes lines
 * its peers hold. Times of 0 note nothing and only read the peers' calls again. */
static void note_probe(Core *c, int kind, double plain, double nt) {
    Stores *st = &c->kinds[kind];
    if (nt > 0 && plain > 0) {
        /* the median of the last three ratios: a probe the scheduler interrupted (ranks
         * sharing cores) moves nothing, and two of a new kind turn the choice */
        double *h = st->logs;
        h[st->probes % 3] = log(plain / nt);
        st->probes++;
        if (st->probes < 3)
            st->log_ratio = st->probes == 1 ? h[0] : 0.5 * (h[0] + h[1]);
        else
            st->log_ratio = fmax(fmin(h[0], h[1]), fmin(fmax(h[0], h[1]), h[2]));
        if (st->log_ratio > log(NT_ABOVE[kind]))
            st->own = 1;
        else if (st->log_ratio < log(PLAIN_BELOW[kind]))
            st->own = 0;
    }
    int64_t word = 0, any = 0;
    for (int k = 0; k < KINDS; k++) word |= (int64_t)c->kinds[k].own << k;
    if (load(c->stores[c->me]) != word)
        store(c->stores[c->me], word);
    for (int r = 0; r < c->n; r++) any |= load(c->stores[r]);
    for (int k = 0; k < KINDS; k++) c->kinds[k].nt = (int)((any >> k) & 1);
}

static void copy_measured(Core *c, char *dst, const char *src, size_t len, int kind) {
    Stores *st = &c->kinds[kind];
    if (len >= 2 * PROBE_BYTES && (st->due -= (int64_t)len) < 0) {
        st->due = st->nt ? PROBE_NT : PROBE_PLAIN;
        int nt_first = (int)(st->probes & 1);
        uint64_t t0, t1, t2;
        fence(); /* earlier stores out of the way of the timing */
        t0 = ticks();
        if (nt_first)
            copy_nt(dst, src, PROBE_BYTES);
        else
            memcpy(dst, src, PROBE_BYTES);
        fence();
        t1 = ticks();
        if (nt_first)
            memcpy(dst + PROBE_BYTES, src + PROBE_BYTES, PROBE_BYTES);
        else
            copy_nt(dst + PROBE_BYTES, src + PROBE_BYTES, PROBE_BYTES);
        fence();
        t2 = ticks();
        note_probe(c, kind, (double)(nt_first ? t2 - t1 : t1 - t0), (double)(nt_first ? t1 - t0 : t2 - t1));
        dst += 2 * PROBE_BYTES;
        src += 2 * PROBE_BYTES;
        len -= 2 * PROBE_BYTES;
    }
    if (st->nt && len >= NONTEMPORAL_BYTES)
        copy_nt(dst, src, len);
    else
        memcpy(dst, src, len);
}

/* Copy len bytes into shared memory that a peer core reads next, a destination of `kind`
 * (SLOTS or STAGED): non-temporal from `nt` bytes up (0: never; c->nt_bytes, or
 * c->nt_bcast for a broadcast's root), below that by the kind's measurement where
 * c->measured (copy_measured). A plain store would first pull each line back from the
 * cache of the peer that read it last, one line at a time: between cores that share no
 * cache (another CCX or socket) several times slower than writing to memory. */
static void copy_shared(Core *c, char *dst, const char *src, size_t len, Py_ssize_t nt, int kind) {
    if (nt > 0 && len >= (size_t)nt)
        copy_nt(dst, src, len);
    else if (c->measured)
        copy_measured(c, dst, src, len, kind);
    else
        memcpy(dst, src, len);
}

/* Copy a piece of a message of `total` bytes out of shared memory into the caller's buffer:
 * non-temporal once the message reaches c->out_nt_bytes, where it no longer stays in the
 * cache. A plain store reads each line of the destination from memory before writing it;
 * one large memcpy skips that read by itself (glibc's non-temporal threshold), but a message
 * copied piece by piece never looks large to it. */
static void copy_out(const Core *c, char *dst, const char *src, size_t len, Py_ssize_t total) {
    if (c->out_nt_bytes > 0 && total >= c->out_nt_bytes)
        copy_nt(dst, src, len);
    else
        memcpy(dst, src, len);
}

static void publish(Core *c, int64_t *w, int64_t v) {
    fence();
    store(w, v);
    wake_sleepers(c, w);
}

/* Sleep (at most DOZE_NS, without the GIL) until the peer counter *v reaches want. */
static void doze(Core *c, int64_t *v, int64_t want) {
    int64_t *flag = c->sleeping[c->me];
    store(flag, 1);
    fence(); /* the flag before the look below (the publisher fences the other way) */
    int64_t seen = load(v);
    if (seen < want) {
        c->waits[2]++;
        Py_BEGIN_ALLOW_THREADS
#if HAVE_FUTEX
        if (c->futex) {
            struct timespec ts = {0, DOZE_NS};
            syscall(SYS_futex, (void *)v, FUTEX_WAIT, (uint32_t)(seen & 0xFFFFFFFF), &ts, NULL, 0);
        } else
#endif
        {
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
        }
        Py_END_ALLOW_THREADS
    }
    store(flag, 0);
}

/* Polls before sleeping, as Channel.budget says; -1 with an exception set. */
static long budget(Core *c) {
    if (c->polite == Py_None)
        return c->spin;
    PyObject *r = PyObject_CallNoArgs(c->polite);
    if (r == NULL)
        return -1;
    int busy = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (busy < 0)
        return -1;
    return busy ? POLITE_SPIN : c->spin;
}

/* Raise the stall's error through c->stalled (which writes this rank's abort word); -1. */
static int stall(Core *c, int r, int64_t want, int kind) {
    PyObject *res = PyObject_CallFunction(c->stalled, "iLi", r, (long long)want, kind);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    PyErr_SetString(PyExc_RuntimeError, "stalled() returned instead of raising");
    return -1;
}

/* The first peer that gave up after a stall, or -1. The abort words lie on a line their
 * ranks write only in barriers and stalls, which therefore stays in the caches that read it. */
static int gave_up(Core *c) {
    for (int r = 0; r < c->n; r++)
        if (r != c->me && load(c->aborts[r]))
            return r;
    return -1;
}

/* Wait until rank r's word *v reaches `want` (no fence after), sleeping (where the wait
 * outlasts its polls) on its counter *z, which r publishes after *v; 0, or -1 with an
 * exception, as wait_all. */
static int wait_on(Core *c, int r, int64_t *v, int64_t *z, int64_t want, int kind) {
    if (load(v) >= want)
        return 0;
    long polls = budget(c);
    if (polls < 0)
        return -1;
    int64_t start = now_ns(), last = start, limit = (int64_t)polls * POLL_NS;
    unsigned spins = 0;
    c->waits[0]++;
    while (load(v) < want) {
        CPU_RELAX();
        c->waits[1]++;
        if (++spins % 64)
            continue;
        int64_t t = now_ns();
        if (t - last < PROGRESS_NS)
            continue;
        last = t;
        PyObject *res = PyObject_CallNoArgs(c->progress);
        if (res == NULL)
            return -1;
        Py_DECREF(res);
        if (t - start >= limit)
            doze(c, z, want);
        int q = gave_up(c);
        if (q >= 0)
            return stall(c, q, kind >= 5 ? want >> STREAM_SHIFT : want, 1);
        if (c->stall_ns > 0 && t - start >= c->stall_ns)
            return stall(c, r, want, kind);
    }
    return 0;
}

/* Wait until rank r's counter *v reaches `want` (no fence after), as wait_on. */
static int wait_one(Core *c, int r, int64_t *v, int64_t want, int kind) { return wait_on(c, r, v, v, want, kind); }

/* Wait until every peer's counter in `ctrs` reaches `want`; 0, or -1 with an exception
 * (a stall: a peer gave up, or this rank waited c->stall_ns for one; `kind` names the
 * counter to c->stalled: 0 the call counters, 4 the reduced-block ones). */
static int wait_all(Core *c, int64_t **ctrs, int64_t want, int kind) {
    for (int r = 0; r < c->n; r++)
        if (r != c->me && wait_one(c, r, ctrs[r], want, kind) < 0)
            return -1;
    fence();
    return 0;
}

/* A C-contiguous view of `obj` (any object with a buffer): its own, or one of the copy
 * `contiguous` makes, which *held keeps (NULL: none) until the caller releases the view and
 * drops it. 0, or -1 with an exception set. */
static int contiguous_view(Core *c, PyObject *obj, Py_buffer *view, PyObject **held) {
    *held = NULL;
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) == 0)
        return 0;
    PyErr_Clear();
    if ((*held = PyObject_CallOneArg(c->contiguous, obj)) == NULL)
        return -1;
    if (PyObject_GetBuffer(*held, view, PyBUF_C_CONTIGUOUS) < 0) {
        Py_CLEAR(*held);
        return -1;
    }
    return 0;
}

/* Copy `obj` (any object with a buffer; any layout through `contiguous`) to dst, at most
 * `limit` bytes (non-temporal from `nt` bytes: copy_shared), or where it holds at most
 * HEAD_DATA bytes and `small` is not NULL, to `small`; 0, or -1 with an exception set. */
static int copy_object(Core *c, PyObject *obj, char *dst, Py_ssize_t limit, Py_ssize_t nt, char *small) {
    Py_buffer view;
    PyObject *held;
    if (contiguous_view(c, obj, &view, &held) < 0)
        return -1;
    int rc = 0;
    if (small != NULL && view.len <= HEAD_DATA)
        dst = small;
    if (view.len > limit) {
        PyErr_Format(PyExc_ValueError, "payload of %zd bytes exceeds the %zd it goes to", view.len, limit);
        rc = -1;
    } else if (view.len && view.buf != dst) {
        copy_shared(c, dst, view.buf, (size_t)view.len, nt, SLOTS);
    }
    PyBuffer_Release(&view);
    Py_XDECREF(held);
    return rc;
}

/* Where rank r's payload of `nbytes` lies in its slot p: on the line of the slot's header
 * up to HEAD_DATA bytes (a small call's peers then read one line of it: the call, its
 * signature and its data), else in the slot's data, which starts on a line of its own. */
static inline char *slot_data(const Core *c, int r, int p, Py_ssize_t nbytes) {
    return nbytes <= HEAD_DATA ? (char *)c->heads[2 * r + p] + HEAD_BYTES : c->slots[2 * r + p];
}

/* Copy `payload` into this rank's slot p (slot_data; non-temporal from `nt` bytes); 0, or -1
 * with an exception set (nothing posted). */
static int put_payload(Core *c, int p, PyObject *payload, Py_ssize_t nt) {
    return payload == Py_None ? 0
                              : copy_object(c, payload, c->slots[2 * c->me + p], c->slot_bytes, nt,
                                            slot_data(c, c->me, p, 0));
}

/* Post the next call (its payload copied in non-temporal from `nt` bytes); its seq, or -1
 * with an exception set (nothing posted). */
static int64_t post(Core *c, int64_t a, int64_t b, int64_t w, PyObject *payload, int64_t win, int64_t wout,
                    Py_ssize_t nt) {
    int64_t *mine = c->seqs[c->me];
    int64_t seq = load(mine) + 1;
    int p = (int)(seq & 1);
    if (load(c->aborts[c->me])) {
        stall(c, c->me, seq, 2);
        return -1;
    }
    if (put_payload(c, p, payload, nt) < 0)
        return -1;
    int64_t *h = c->heads[2 * c->me + p];
    /* The call's number is stored in every post, whichever way its peers wait, so that a
     * peer that waits on the header for a call of another kind sees it, and the mismatch.
     * (Storing the words only where they changed, which spares the line in a loop of one
     * call, made 64-256 B allreduces 10-15 % slower where the vCPUs of the reference machine
     * shared no cache.) */
    h[0] = a;
    h[1] = b;
    h[2] = w;
    h[3] = win;
    h[4] = wout;
    /* a release store: the data and the words above are visible before the word that
     * announces them (and go out together with it: a fence before it would wait here for
     * the data's lines, then take the peers' polled line once more) */
    __atomic_store_n(h + POSTED, seq, __ATOMIC_RELEASE);
    publish(c, mine, seq);
    return seq;
}

/* Which calls wait for their peers' posts on the slots' headers (wait_posted; every post
 * announces itself there and in its counter, so either wait sees it, and a mismatch too):
 * a one-step broadcast, and a reduction or allgather whose payload lies on the header's
 * line (HEAD_DATA bytes): the one line such a call needs from each peer. On the reference
 * machine, where its two vCPUs shared no cache, a 4-byte broadcast took 1.29-1.46 us
 * waiting on the counters (MPICH 1.11-1.42) and 1.03-1.15 on the headers, a 4 KiB one
 * 1.48-1.64 against 1.16-1.30 (MPICH 1.37-1.53), a 4-byte allreduce 1.21-1.33 against
 * 1.07-1.23. Reductions whose data lies on lines of its own took 1-15 % longer on the
 * headers where the vCPUs shared a cache (64 B-16 KiB), and wait on the counters. */
#define HEADER_WAIT_BYTES HEAD_DATA

/* Wait until every peer has posted call seq: where `header`, until its slot's header
 * announces it (the POSTED word, on the line of the signature and of a tiny payload: the
 * one line a small call needs from each peer), sleeping (where the wait outlasts its
 * polls) on its counter, published after that word; else until its counter does. 0, or -1
 * with an exception, as wait_all. */
static int wait_posted(Core *c, int64_t seq, int header) {
    int p = (int)(seq & 1);
    for (int r = 0; r < c->n; r++)
        if (r != c->me && wait_on(c, r, header ? c->heads[2 * r + p] + POSTED : c->seqs[r], c->seqs[r], seq, 0) < 0)
            return -1;
    fence();
    return 0;
}

/* Post, wait for every peer's post (on the headers where `header`: wait_posted) and compare
 * the signatures: seq, -seq on a mismatch, or 0 with an exception set. */
static int64_t exchange(Core *c, int64_t a, int64_t b, int64_t w, PyObject *payload, int uneven, int64_t win,
                        int64_t wout, Py_ssize_t nt, int header) {
    int64_t seq = post(c, a, b, w, payload, win, wout, nt);
    if (seq < 0)
        return 0;
    if (wait_posted(c, seq, header) < 0)
        return 0;
    int q = gave_up(c); /* every peer posted, but one gave up meanwhile: no rank uses the call */
    if (q >= 0) {
        stall(c, q, seq, 1);
        return 0;
    }
    int p = (int)(seq & 1);
    for (int r = 0; r < c->n; r++) {
        if (r == c->me)
            continue;
        int64_t *h = c->heads[2 * r + p];
        if (h[0] != a || h[2] != w || (h[1] != b && !uneven))
            return -seq;
    }
    return seq;
}

/* -- single-copy broadcasts and allgathers --------------------------------------------------
 * From c->cma_bytes per rank (c->cma_bcast for a broadcast), an agreed allgather or
 * broadcast skips the slots: each rank that sends puts the address of its data in its slot
 * of the call and publishes seq << STREAM_SHIFT | 1 in its streams word; each rank that
 * receives reads the data straight out of the sender's memory with cross-memory attach
 * (Linux's process_vm_readv: one copy, by the kernel, where the slots take two) and
 * publishes the same value in its takes word; a sender returns once every receiver has,
 * so its buffer is not changed while read. A broadcast's root in place, whose core would
 * otherwise wait, also writes a share of the message into each reader's memory
 * (process_vm_writev) while the readers read the rest.
 * Every rank of the node takes this path or none: the sizes are agreed when the channel is
 * made, and 0 unless every rank could read and write a peer's memory then. */

/* Move n bytes between dst here and `remote` in process pid: read them into dst
 * (process_vm_readv), or with `write` write dst's bytes there (process_vm_writev); 0, or -1
 * with an exception set. */
static int cma_move(pid_t pid, char *dst, uintptr_t remote, size_t n, int write) {
#if defined(__linux__)
    while (n) {
        struct iovec here = {dst, n}, there = {(void *)remote, n};
        ssize_t got = write ? process_vm_writev(pid, &here, 1, &there, 1, 0)
                            : process_vm_readv(pid, &here, 1, &there, 1, 0);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0) {
            PyErr_Format(PyExc_OSError, "cross-memory attach: %s %zu bytes of process %d failed: %s",
                         write ? "writing" : "reading", n, (int)pid, got < 0 ? strerror(errno) : "nothing moved");
            return -1;
        }
        dst += got;
        remote += (uintptr_t)got;
        n -= (size_t)got;
    }
    return 0;
#else
    (void)pid, (void)dst, (void)remote, (void)n, (void)write;
    PyErr_SetString(PyExc_OSError, "cross-memory attach is Linux's");
    return -1;
#endif
}

/* Where the n bytes at `remote` in rank r's process are mapped here: inside its segment of
 * the node's arena (core.segments), which every rank maps; else NULL. */
static char *mapped(const Core *c, int r, uintptr_t remote, size_t n) {
    if (c->seg_bytes <= 0 || remote < c->seg_there[r])
        return NULL;
    size_t at = remote - c->seg_there[r];
    return at <= (size_t)c->seg_bytes && n <= (size_t)c->seg_bytes - at ? c->seg_here[r] + at : NULL;
}

/* Move n bytes between dst here and `remote` in rank r's process (read them into dst, or with
 * `write` write dst's bytes there), as part of a message of `total` bytes: copied through the
 * mapping where they lie in r's arena segment, whose 4 KiB shared pages the kernel's
 * cross-memory attach pins one by one (twice the time of a copy on the reference machine);
 * else by cross-memory attach. 0, or -1 with an exception set. */
static int peer_move(Core *c, int r, char *dst, uintptr_t remote, size_t n, int write, Py_ssize_t total) {
    char *here = mapped(c, r, remote, n);
    if (here == NULL)
        return cma_move((pid_t)c->pids[r], dst, remote, n, write);
    if (write)
        copy_out(c, here, dst, n, total);
    else
        copy_out(c, dst, here, n, total);
    c->mapped_bytes += (int64_t)n;
    return 0;
}

/* Read rank r's data of call seq, n bytes from byte `from` of what it offered, into dst (part
 * of a message of `total` bytes). */
static int read_peer(Core *c, int64_t seq, int r, char *dst, Py_ssize_t from, Py_ssize_t n, Py_ssize_t total) {
    int64_t *addr = (int64_t *)c->slots[2 * r + (int)(seq & 1)];
    if (wait_one(c, r, c->streams[r], (seq << STREAM_SHIFT) + 1, 5) < 0)
        return -1;
    fence(); /* the address after the word that published it */
    return peer_move(c, r, dst, (uintptr_t)load(addr) + (uintptr_t)from, (size_t)n, 0, total);
}

/* Offer `buf` (this rank's data of call seq) to the peers' reads. */
static void offer(Core *c, int64_t seq, const char *buf) {
    store((int64_t *)c->slots[2 * c->me + (int)(seq & 1)], (int64_t)(uintptr_t)buf);
    publish(c, c->streams[c->me], (seq << STREAM_SHIFT) + 1);
}

/* The bytes at the end of an n-byte broadcast that a root in place writes into each of its
 * `ranks` - 1 readers while they read the rest: 1 / ranks of it, where the root's writes
 * take as long as each reader's read, in whole cache lines (0 below one). */
static Py_ssize_t root_share(Py_ssize_t nbytes, int ranks) { return nbytes / ranks / LINE_BYTES * LINE_BYTES; }

/* src: where the root's data lies when not in buf (NULL: in buf); the root offers it and
 * copies it into buf while the others read it; in place, it writes the last root_share
 * bytes into every reader's buf instead, in turn from its next rank, once the reader has
 * offered it (its address in the reader's slot of the call, its streams word at | 1), and
 * then publishes | 2 in its streams word. The share is published in the root's slot
 * beside its address, so the readers need not know whether it broadcast in place. */
static int single_copy_broadcast(Core *c, int64_t seq, int root, char *buf, Py_ssize_t nbytes, const char *src) {
    int64_t base = seq << STREAM_SHIFT;
    int parity = (int)(seq & 1);
    int64_t *at_root = (int64_t *)c->slots[2 * root + parity];
    if (c->me == root) {
        Py_ssize_t share = src ? 0 : root_share(nbytes, c->n), from = nbytes - share;
        store(at_root + 1, share);
        offer(c, seq, src ? src : buf);
        if (src)
            copy_out(c, buf, src, (size_t)nbytes, nbytes);
        for (int k = 1; share && k < c->n; k++) {
            int r = (root + k) % c->n;
            if (wait_one(c, r, c->streams[r], base + 1, 5) < 0)
                return -1;
            fence(); /* the reader's address after the word that published it */
            uintptr_t there = (uintptr_t)load((int64_t *)c->slots[2 * r + parity]) + (uintptr_t)from;
            if (peer_move(c, r, buf + from, there, (size_t)share, 1, nbytes) < 0)
                return -1;
        }
        publish(c, c->streams[root], base + 2);
        return wait_all(c, c->takes, base + 1, 6);
    }
    offer(c, seq, buf); /* where the root writes its share */
    if (wait_one(c, root, c->streams[root], base + 1, 5) < 0)
        return -1;
    fence(); /* the address and share after the word that published them */
    Py_ssize_t share = (Py_ssize_t)load(at_root + 1);
    share = share < 0 || share > nbytes ? 0 : share; /* as root_share gives it; a stray word counts as none */
    int rc = peer_move(c, root, buf, (uintptr_t)load(at_root), (size_t)(nbytes - share), 0, nbytes);
    if (share) { /* the root writes into buf until it publishes | 2: wait for that even where the read
                  * failed, so buf is not given back while written; the read's error wins */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        int waited = wait_one(c, root, c->streams[root], base + 2, 5);
        if (type != NULL) {
            PyErr_Clear();
            PyErr_Restore(type, value, tb);
        } else if (waited < 0)
            rc = -1;
    }
    if (rc < 0)
        return -1;
    publish(c, c->takes[c->me], base + 1);
    return 0;
}

/* From this many bytes of output, where copies out stay in the caches, an allgather by
 * single copy of 2 ranks chooses which block to offer by a cache line's round trip to the
 * other rank, timed in the first such call and every OFFER_CHECK_EVERY-th after it with
 * OFFER_TRIPS round trips through a spare word of the call's slots: its own block of the
 * output, copied in first, below OFFER_NEAR_NS, else its source (single_copy_allgather) */
#define OFFER_OUTPUT_BYTES (4 << 20)
#define OFFER_CHECK_EVERY 64
#define OFFER_TRIPS 16
#define OFFER_NEAR_NS 300.0
#define OFFER_PATIENCE_NS 1000000

/* Round trips of one line between two processes, for the values first .. last: the leader
 * stores each in *mine and waits until *theirs holds it; the other waits for it there, then
 * stores it in *mine. A wait looks at the clock every look + 1 polls (look: a power of two,
 * less one) and gives up past `deadline` (ns); with `renew` > 0 the deadline moves to renew
 * ns after the first look in each new round, so that it counts from the other's last answer.
 * 0, or -1 where it gave up (line_round_trip, partner_trip). */
static int line_trips(int64_t *mine, int64_t *theirs, int leads, int64_t first, int64_t last, int64_t deadline,
                      int64_t renew, int64_t look) {
    int64_t polls = 0, since = first - 1;
    for (int64_t v = first; v <= last; v++) {
        if (leads)
            store(mine, v);
        while (load(theirs) != v) {
            if ((++polls & look) == 0) {
                int64_t t = now_ns();
                if (renew > 0 && v != since) {
                    since = v;
                    deadline = t + renew;
                } else if (t > deadline) {
                    return -1;
                }
            }
            CPU_RELAX();
        }
        if (!leads)
            store(mine, v);
    }
    return 0;
}

/* OFFER_TRIPS round trips of one line between this rank and `peer` (both in call seq, which
 * leaves the slots' third word free), after one that waits for the other to arrive: the
 * lower rank stores, the higher answers. The ns a round trip, or 0 where an answer did not
 * come within OFFER_PATIENCE_NS of this rank's start (no wait here outlasts it; the other
 * then gives up too, or finishes its count). */
static double partner_trip(Core *c, int64_t seq, int peer) {
    int p = (int)(seq & 1), leads = c->me < peer;
    int64_t *mine = (int64_t *)c->slots[2 * c->me + p] + 2, *theirs = (int64_t *)c->slots[2 * peer + p] + 2;
    int64_t v = seq * (OFFER_TRIPS + 1); /* from here on, values no earlier call's trips had */
    int64_t deadline = now_ns() + OFFER_PATIENCE_NS;
    if (line_trips(mine, theirs, leads, v + 1, v + 1, deadline, 0, 255) < 0) /* meets the other: untimed */
        return 0.0;
    int64_t timed = now_ns();
    if (line_trips(mine, theirs, leads, v + 2, v + OFFER_TRIPS + 1, deadline, 0, 255) < 0)
        return 0.0;
    return (double)(now_ns() - timed) / OFFER_TRIPS;
}

static int single_copy_allgather(Core *c, int64_t seq, char *buf, const Py_ssize_t *off, const char *src) {
    int me = c->me, n = c->n;
    size_t len = (size_t)(off[me + 1] - off[me]);
    /* Which block a rank offers the peers' reads. Where its copies out go past the caches
     * (non-temporal), it copies its own block into buf first and offers that block: an
     * output that large was most likely mapped afresh, on huge pages (numpy asks for them
     * from 4 MiB), which the kernel's reads pin whole, while src may lie in a heap's 4 KiB
     * pages, which they pin one by one (a 16 MiB read from those took 1.6-1.8 x as long on
     * the reference machine). Where a smaller output stays in the caches it offers src,
     * which the call does not write, and copies its own block last. In between, from
     * OFFER_OUTPUT_BYTES, the block is faster where the ranks' cores share a cache, and
     * slower where they do not: each rank then rewrites lines its peer read in the last
     * call, and the peer reads lines just written, across caches (4 MiB allgathers of 2
     * ranks on the reference machine, whose host moves its two virtual CPUs between cores
     * that share a cache and cores that do not every few minutes: the block 246-392 us
     * against 311-427 offering src where they share one, MPICH 234-361; 646-813 against
     * 303-454 where they do not). The caches' own description cannot tell there, so each
     * of 2 ranks times a cache line's round trip to the other (about 100 ns against 500
     * on that machine) where their waits spin (a core each, or HPCDL_SHM_SPIN); with more
     * ranks one pair's trip would not speak for every peer, and the source is offered.
     * And always where src lies in its
     * arena segment, which the peers copy through the mapping, it offers src. The reads
     * below write the other blocks of buf. */
    Offers *o = &c->offers;
    int nt = c->out_nt_bytes > 0 && off[n] >= c->out_nt_bytes;
    int large = !nt && n == 2 && off[n] >= OFFER_OUTPUT_BYTES;
    if (large && o->calls++ % OFFER_CHECK_EVERY == 0 && c->spin > POLITE_SPIN) {
        double trip = partner_trip(c, seq, 1 - me);
        if (trip > 0) {
            o->trip_ns = trip;
            o->checks++;
            o->block = trip < OFFER_NEAR_NS;
        }
    }
    int first = src && (nt || (large && o->block)) && !mapped(c, me, (uintptr_t)src, len);
    if (first)
        copy_out(c, buf + off[me], src, len, off[n]);
    offer(c, seq, src && !first ? src : buf + off[me]);
    for (int k = 1; k < n; k++) { /* each rank starts at its next peer: the reads spread over the senders */
        int r = (me + k) % n;
        if (off[r + 1] > off[r] && read_peer(c, seq, r, buf + off[r], 0, off[r + 1] - off[r], off[n]) < 0)
            return -1;
    }
    if (src && !first) /* the peers read src, which this call does not write */
        copy_out(c, buf + off[me], src, len, off[n]);
    publish(c, c->takes[me], (seq << STREAM_SHIFT) + 1);
    return wait_all(c, c->takes, (seq << STREAM_SHIFT) + 1, 6);
}

/* -- broadcasts streamed through the root's slot ------------------------------------------
 * An agreed broadcast moves through the root's slot of its call, used as a ring of `piece`
 * bytes: the root copies piece k in and publishes seq << STREAM_SHIFT | (k + 1) in its
 * streams word; a reader waits for that and copies the piece out, so the root's copies in
 * and the readers' copies out overlap. Where the message wraps the ring, a reader also
 * publishes each piece it has copied in its own word, and the root waits for every
 * reader's before it overwrites a place. From c->cma_bcast bytes the readers read the
 * root's memory instead (single_copy_broadcast). `src` (the root's, may be NULL): its data
 * where it lies when not yet in buf; the root copies each piece from there into its slot,
 * publishes it, and then copies it into buf while it is in the cache. */
static int stream(Core *c, int64_t seq, int root, char *buf, Py_ssize_t nbytes, Py_ssize_t piece, const char *src) {
    if (c->cma_bcast > 0 && nbytes >= c->cma_bcast)
        return single_copy_broadcast(c, seq, root, buf, nbytes, src);
    int me = c->me;
    const char *from = src && src != buf && me == root ? src : NULL; /* the root tees: into buf too */
    char *ring = c->slots[2 * root + (int)(seq & 1)];
    Py_ssize_t places = c->slot_bytes / piece, count = (nbytes + piece - 1) / piece;
    int64_t base = seq << STREAM_SHIFT;
    int wraps = count > places;
    for (Py_ssize_t k = 0; k < count; k++) {
        Py_ssize_t off = k * piece, len = nbytes - off < piece ? nbytes - off : piece;
        char *at = ring + (k % places) * piece;
        if (me == root) {
            if (k >= places && wait_all(c, c->streams, base + k - places + 1, 5) < 0)
                return -1;
            copy_shared(c, at, from ? from + off : buf + off, (size_t)len, c->nt_bcast, SLOTS);
            if (from) { /* published first, then into buf while the piece is in the cache */
                publish(c, c->streams[me], base + k + 1);
                copy_out(c, buf + off, from + off, (size_t)len, nbytes);
                continue;
            }
        } else {
            if (wait_one(c, root, c->streams[root], base + k + 1, 5) < 0)
                return -1;
            fence(); /* the piece after the word that published it */
            copy_out(c, buf + off, at, (size_t)len, nbytes);
            if (!wraps)
                continue;
        }
        publish(c, c->streams[me], base + k + 1);
    }
    return 0;
}

/* An agreed allgather through every rank's slot of its call, each used as a ring of `piece`
 * bytes as a broadcast's is: in round k every rank copies piece k of its block (buf from
 * byte off[me] to off[me + 1]) into its ring and publishes it in its streams word, then
 * copies piece k of every peer's block into buf as each is published; where a block wraps
 * the ring, it then publishes the round in its takes word, which every rank waits for
 * before it overwrites a place. */
static int gather_stream(Core *c, int64_t seq, char *buf, const Py_ssize_t *off, Py_ssize_t piece, const char *src) {
    int me = c->me, n = c->n, p = (int)(seq & 1);
    Py_ssize_t places = c->slot_bytes / piece, rounds = 0, most = 0;
    for (int r = 0; r < n; r++) {
        Py_ssize_t k = (off[r + 1] - off[r] + piece - 1) / piece;
        rounds = k > rounds ? k : rounds;
        most = off[r + 1] - off[r] > most ? off[r + 1] - off[r] : most;
    }
    if (c->cma_bytes > 0 && most >= c->cma_bytes)
        return single_copy_allgather(c, seq, buf, off, src);
    const char *mine = src ? src : buf + off[me];
    int64_t base = seq << STREAM_SHIFT;
    int wraps = rounds > places;
    for (Py_ssize_t k = 0; k < rounds; k++) {
        Py_ssize_t at = (k % places) * piece, from = k * piece;
        if (off[me] + from < off[me + 1]) {
            Py_ssize_t len = off[me + 1] - off[me] - from < piece ? off[me + 1] - off[me] - from : piece;
            if (k >= places && wait_all(c, c->takes, base + k - places + 1, 6) < 0)
                return -1;
            copy_shared(c, c->slots[2 * me + p] + at, mine + from, (size_t)len, c->nt_bytes, SLOTS);
            if (src) /* this rank's own piece too, while it is in the cache */
                copy_out(c, buf + off[me] + from, mine + from, (size_t)len, off[n]);
            publish(c, c->streams[me], base + k + 1);
        }
        for (int r = 0; r < n; r++) {
            if (r == me || off[r] + from >= off[r + 1])
                continue;
            Py_ssize_t len = off[r + 1] - off[r] - from < piece ? off[r + 1] - off[r] - from : piece;
            if (wait_one(c, r, c->streams[r], base + k + 1, 5) < 0)
                return -1;
            fence(); /* the piece after the word that published it */
            copy_out(c, buf + off[r] + from, c->slots[2 * r + p] + at, (size_t)len, off[n]);
        }
        if (wraps)
            publish(c, c->takes[me], base + k + 1);
    }
    return 0;
}

/* -- reductions in rank order --------------------------------------------------------- */
#define FLOAT_KERNEL(NAME, T)                                                                 \
    static void NAME(char **src, int n, Py_ssize_t lo, Py_ssize_t hi, char *dst, int op) {    \
        T *o = (T *)dst;                                                                      \
        Py_ssize_t m = hi - lo;                                                               \
        const T *s0 = (const T *)src[0] + lo, *s1 = (const T *)src[1] + lo;                   \
        if (op == OP_PROD)                                                                    \
            for (Py_ssize_t i = 0; i < m; i++) o[i] = s0[i] * s1[i];                          \
        else                                                                                  \
            for (Py_ssize_t i = 0; i < m; i++) o[i] = s0[i] + s1[i];                          \
        for (int r = 2; r < n; r++) {                                                         \
            const T *s = (const T *)src[r] + lo;                                              \
            if (op == OP_PROD)                                                                \
                for (Py_ssize_t i = 0; i < m; i++) o[i] = o[i] * s[i];                        \
            else                                                                              \
                for (Py_ssize_t i = 0; i < m; i++) o[i] = o[i] + s[i];                        \
        }                                                                                     \
        if (op == OP_AVG) {                                                                   \
            T d = (T)n;                                                                       \
            for (Py_ssize_t i = 0; i < m; i++) o[i] = o[i] / d;                               \
        }                                                                                     \
    }

/* integers wrap as numpy's do (arithmetic in the unsigned type); avg truncates toward zero */
#define INT_KERNEL(NAME, T, U)                                                                \
    static void NAME(char **src, int n, Py_ssize_t lo, Py_ssize_t hi, char *dst, int op) {    \
        T *o = (T *)dst;                                                                      \
        Py_ssize_t m = hi - lo;                                                               \
        for (Py_ssize_t i = 0; i < m; i++) o[i] = ((const T *)src[0])[lo + i];                \
        for (int r = 1; r < n; r++) {                                                         \
            const T *s = (const T *)src[r] + lo;                                              \
            switch (op) {                                                                     \
            case OP_PROD:                                                                     \
                for (Py_ssize_t i = 0; i < m; i++) o[i] = (T)((U)o[i] * (U)s[i]);             \
                break;                                                                        \
            case OP_MIN:                                                                      \
                for (Py_ssize_t i = 0; i < m; i++) o[i] = s[i] < o[i] ? s[i] : o[i];          \
                break;                                                                        \
            case OP_MAX:                                                                      \
                for (Py_ssize_t i = 0; i < m; i++) o[i] = s[i] > o[i] ? s[i] : o[i];          \
                break;                                                                        \
            default:                                                                          \
                for (Py_ssize_t i = 0; i < m; i++) o[i] = (T)((U)o[i] + (U)s[i]);             \
            }                                                                                 \
        }                                                                                     \
        if (op == OP_AVG)                                                                     \
            for (Py_ssize_t i = 0; i < m; i++) o[i] = (T)(o[i] / (T)n);                       \
    }

FLOAT_KERNEL(red_f32, float)
FLOAT_KERNEL(red_f64, double)
INT_KERNEL(red_i8, int8_t, uint8_t)
INT_KERNEL(red_i16, int16_t, uint16_t)
INT_KERNEL(red_i32, int32_t, uint32_t)
INT_KERNEL(red_i64, int64_t, uint64_t)
INT_KERNEL(red_u8, uint8_t, uint8_t)

typedef void (*kernel)(char **, int, Py_ssize_t, Py_ssize_t, char *, int);

/* The kernel for a dtype code and op, or NULL where numpy must reduce (half-precision
 * types; min and max of floats, whose NaN and signed-zero rules are numpy's own). */
static kernel kernel_for(int dtype, int op, int *itemsize) {
    int fl = dtype == F32 || dtype == F64;
    if (op < OP_SUM || op > OP_PROD || (fl && (op == OP_MIN || op == OP_MAX)))
        return NULL;
    switch (dtype) {
    case F32: *itemsize = 4; return red_f32;
    case F64: *itemsize = 8; return red_f64;
    case I8: *itemsize = 1; return red_i8;
    case I16: *itemsize = 2; return red_i16;
    case I32: *itemsize = 4; return red_i32;
    case I64: *itemsize = 8; return red_i64;
    case U8: *itemsize = 1; return red_u8;
    default: return NULL;
    }
}

/* Reduce elements [lo, hi) of every rank's payload of call seq (`posted` bytes each:
 * slot_data) into dst, in rank order. 0, or -1 with an exception set. */
static int reduce_slots(Core *c, int64_t seq, kernel k, int op, Py_ssize_t itemsize, Py_ssize_t lo, Py_ssize_t hi,
                        char *dst, Py_ssize_t posted) {
    if (hi <= lo)
        return 0;
    int p = (int)(seq & 1);
    if (c->n == 1) {
        memcpy(dst, slot_data(c, 0, p, posted) + lo * itemsize, (size_t)((hi - lo) * itemsize));
        return 0;
    }
    char *src[64], **s = src;
    if (c->n > 64 && (s = PyMem_Malloc(sizeof(char *) * (size_t)c->n)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int r = 0; r < c->n; r++) s[r] = slot_data(c, r, p, posted);
    k(s, c->n, lo, hi, dst, op);
    if (s != src)
        PyMem_Free(s);
    return 0;
}

/* -- reduce-scatters read by single copy ----------------------------------------------------
 * From c->cma_bytes of input, an agreed reduce-scatter may skip the window: every rank
 * offers its input as an allgather's sender does, with its vote (offer_vote: whether its
 * input is apart from its output and its staging is slow; where any rank votes against it,
 * every rank stages the call instead); each rank reads its block (bytes lo to hi of every
 * rank's input) out of each peer's memory, REDUCE_PIECE bytes of each at a time into its
 * scratch (starting at its next peer, so the reads spread over the ranks), and reduces them
 * with its own in rank order into out; then it publishes its takes word, and returns once
 * every peer has (its input is not changed while read). */
#define REDUCE_PIECE ((Py_ssize_t)256 << 10)

/* Make room for reading `piece` bytes of each of the n - 1 peers' inputs (the scratch) and
 * return the array of n input pointers the kernel takes: `stack` where n fits it, else
 * one allocated here (PyMem_Free it when it is not `stack`); NULL with an exception set. */
static char **reading_room(Core *c, Py_ssize_t piece, char **stack) {
    int n = c->n;
    if ((n - 1) * piece > c->scratch_bytes) {
        char *grown = PyMem_Realloc(c->scratch, (size_t)((n - 1) * piece));
        if (grown == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        c->scratch = grown, c->scratch_bytes = (n - 1) * piece;
    }
    char **s = n > 64 ? PyMem_Malloc(sizeof(char *) * (size_t)n) : stack;
    if (s == NULL)
        PyErr_NoMemory();
    return s;
}

/* Reduce bytes `from` to from + m of every rank's input of call seq in rank order into dst:
 * the peers' read into the scratch (which stays in the cache), starting at this rank's next
 * peer so the reads spread over the ranks, this rank's own from src. 0, or -1 with an
 * exception set. */
static int reduce_read(Core *c, int64_t seq, const char *src, Py_ssize_t from, Py_ssize_t m, char *dst, char **s,
                       Py_ssize_t piece, kernel k, int op, Py_ssize_t isz) {
    int me = c->me, n = c->n;
    for (int j = 1; j < n; j++) {
        int r = (me + j) % n;
        s[r] = c->scratch + (j - 1) * piece;
        if (read_peer(c, seq, r, s[r], from, m, m) < 0)
            return -1;
    }
    s[me] = (char *)src + from;
    k(s, n, 0, m / isz, dst, op);
    return 0;
}

/* Offer src for call seq with this rank's vote for reading it by single copy (word 3 of its
 * slot of the call) and wait for every peer's offer: 1 where every rank votes for it, 0
 * where one votes against it (every rank then stages the call, and no one reads), -1 with
 * an exception set where a peer stalls. */
static int offer_vote(Core *c, int64_t seq, const char *src, int vote) {
    int p = (int)(seq & 1);
    store((int64_t *)c->slots[2 * c->me + p] + 3, vote);
    offer(c, seq, src);
    if (wait_all(c, c->streams, (seq << STREAM_SHIFT) + 1, 5) < 0)
        return -1;
    for (int r = 0; r < c->n; r++)
        if (!load((int64_t *)c->slots[2 * r + p] + 3))
            return 0;
    return 1;
}

static int single_copy_reduce_scatter(Core *c, int64_t seq, const char *src, Py_ssize_t lo, Py_ssize_t hi, char *out,
                                      int vote, kernel k, int op, Py_ssize_t isz) {
    int64_t done = (seq << STREAM_SHIFT) + 1;
    Py_ssize_t len = hi - lo, piece = REDUCE_PIECE / isz * isz;
    piece = piece < len ? piece : len;
    int agreed = offer_vote(c, seq, src, vote);
    if (agreed <= 0)
        return agreed;
    char *stack[64], **s = reading_room(c, piece, stack);
    if (s == NULL)
        return -1;
    int rc = 0;
    for (Py_ssize_t a = 0; a < len && rc == 0; a += piece)
        rc = reduce_read(c, seq, src, lo + a, len - a < piece ? len - a : piece, out + a, s, piece, k, op, isz);
    if (s != stack)
        PyMem_Free(s);
    if (rc < 0)
        return -1;
    publish(c, c->takes[c->me], done);
    return wait_all(c, c->takes, done, 6) < 0 ? -1 : 1;
}

/* Element r * q + min(r, rem) of count = q * n + rem: where block r starts (MPICH's blocks,
 * collectives.blocks.block_counts). */
static Py_ssize_t block_start(Py_ssize_t count, int n, int r) {
    Py_ssize_t q = count / n, rem = count % n;
    return (Py_ssize_t)r * q + (r < rem ? r : rem);
}

/* -- allreduces read by single copy --------------------------------------------------------
 * An agreed allreduce into a separate output skips the window: a reduce-scatter and an
 * allgather, each by single copy. Every rank offers its input (as an allgather's sender
 * does), its out (word 2 of its slot of the call) and its vote (word 3: whether its call
 * can go this way, i.e. its input and output are apart), and waits for every peer's offer;
 * unless every rank voted for it, every rank returns 0 alike, and stages the call through
 * the window instead. Otherwise, piece by piece (REDUCE_PIECE bytes), each rank reduces
 * piece k of its block (MPICH's blocks) of every rank's input into out, reading the peers'
 * pieces into the scratch as single_copy_reduce_scatter does, and publishes | k + 2 in its
 * streams word; then it reads piece k of every peer's reduced block straight from the
 * peer's out into its own, once the peer published it, while it is still in the caches.
 * Last, it publishes its takes word and returns once every peer has (its input and out are
 * not changed while read). Each rank writes its output once: no staged copy, no copy out of
 * the window. 1 (done), 0 (declined), or -1 with an exception set. */
static int single_copy_allreduce(Core *c, int64_t seq, const char *src, char *out, Py_ssize_t nbytes, int vote,
                                 kernel k, int op, Py_ssize_t isz) {
    int me = c->me, n = c->n, p = (int)(seq & 1);
    int64_t base = seq << STREAM_SHIFT;
    store((int64_t *)c->slots[2 * me + p] + 2, (int64_t)(uintptr_t)out);
    int agreed = offer_vote(c, seq, src, vote);
    if (agreed <= 0)
        return agreed;
    Py_ssize_t count = nbytes / isz, lo = block_start(count, n, me) * isz, len = block_start(count, n, me + 1) * isz - lo;
    Py_ssize_t most = (count + n - 1) / n * isz, piece = REDUCE_PIECE / isz * isz;
    piece = piece < most ? piece : most;
    char *stack[64], **s = reading_room(c, piece, stack);
    if (s == NULL)
        return -1;
    int rc = 0;
    for (Py_ssize_t a = 0, round = 0; a < most && rc == 0; a += piece, round++) {
        if (a < len) { /* piece `round` of this rank's block, reduced over every rank's input */
            Py_ssize_t m = len - a < piece ? len - a : piece;
            if ((rc = reduce_read(c, seq, src, lo + a, m, out + lo + a, s, piece, k, op, isz)) < 0)
                break;
            publish(c, c->streams[me], base + 2 + round);
        }
        for (int j = 1; j < n && rc == 0; j++) { /* each rank starts at its next peer: the reads spread */
            int r = (me + j) % n;
            Py_ssize_t at = block_start(count, n, r) * isz + a, z = block_start(count, n, r + 1) * isz;
            if (at >= z)
                continue;
            if ((rc = wait_one(c, r, c->streams[r], base + 2 + round, 5)) < 0)
                break;
            fence(); /* the piece after the word that published it */
            uintptr_t there = (uintptr_t)load((int64_t *)c->slots[2 * r + p] + 2) + (uintptr_t)at;
            rc = peer_move(c, r, out + at, there, (size_t)(z - at < piece ? z - at : piece), 0, nbytes);
        }
    }
    if (s != stack)
        PyMem_Free(s);
    if (rc < 0)
        return -1;
    publish(c, c->takes[me], base + 1);
    return wait_all(c, c->takes, base + 1, 6) < 0 ? -1 : 1;
}

/* -- the Python types ------------------------------------------------------------------- */
static int read_addrs(PyObject *seq, Py_ssize_t want, void ***out, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != want) {
        PyErr_Format(PyExc_ValueError, "%s: %zd addresses, expected %zd", what, PySequence_Fast_GET_SIZE(fast), want);
        Py_DECREF(fast);
        return -1;
    }
    void **a = PyMem_Calloc((size_t)want, sizeof(void *));
    if (a == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        a[i] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(fast, i));
        if (a[i] == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "%s: a null address", what);
            PyMem_Free(a);
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    *out = a;
    return 0;
}

/* `want` integers from the sequence `seq` into a new array *out (the caller frees it); 0, or
 * -1 with an exception set naming `what`. */
static int read_sizes(PyObject *seq, Py_ssize_t want, Py_ssize_t **out, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    Py_ssize_t *a = NULL;
    if (PySequence_Fast_GET_SIZE(fast) != want)
        PyErr_Format(PyExc_ValueError, "%s: %zd entries, expected %zd", what, PySequence_Fast_GET_SIZE(fast), want);
    else if ((a = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)want)) == NULL)
        PyErr_NoMemory();
    for (Py_ssize_t i = 0; a != NULL && i < want; i++) {
        a[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, i));
        if (a[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(a);
            a = NULL;
        }
    }
    Py_DECREF(fast);
    *out = a;
    return a == NULL ? -1 : 0;
}

static int Core_init(Core *c, PyObject *args, PyObject *kw) {
    static char *names[] = {"me",         "seqs",  "sleeping", "heads",   "slots", "slot_bytes", "spin",  "progress",
                            "contiguous", "futex", "aborts",   "stalled", "dones", "streams",    "takes", "stores",
                            NULL};
    int me, futex;
    PyObject *seqs, *sleeping, *heads, *slots, *progress, *contiguous, *aborts, *stalled, *dones, *streams, *takes,
        *stores;
    Py_ssize_t slot_bytes;
    long spin;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iOOOOnlOOpOOOOOO", names, &me, &seqs, &sleeping, &heads, &slots,
                                     &slot_bytes, &spin, &progress, &contiguous, &futex, &aborts, &stalled, &dones,
                                     &streams, &takes, &stores))
        return -1;
    Py_ssize_t n = PySequence_Size(seqs);
    if (n < 1 || n > INT_MAX || me < 0 || me >= n) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "me must index seqs");
        return -1;
    }
    if (!PyCallable_Check(progress) || !PyCallable_Check(contiguous) || !PyCallable_Check(stalled)) {
        PyErr_SetString(PyExc_TypeError, "progress, contiguous and stalled must be callable");
        return -1;
    }
    if (c->seqs != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Core is initialised once");
        return -1;
    }
    if (read_addrs(seqs, n, (void ***)&c->seqs, "seqs") < 0 ||
        read_addrs(sleeping, n, (void ***)&c->sleeping, "sleeping") < 0 ||
        read_addrs(aborts, n, (void ***)&c->aborts, "aborts") < 0 ||
        read_addrs(dones, n, (void ***)&c->dones, "dones") < 0 ||
        read_addrs(streams, n, (void ***)&c->streams, "streams") < 0 ||
        read_addrs(takes, n, (void ***)&c->takes, "takes") < 0 ||
        read_addrs(stores, n, (void ***)&c->stores, "stores") < 0 ||
        read_addrs(heads, 2 * n, (void ***)&c->heads, "heads") < 0 ||
        read_addrs(slots, 2 * n, (void ***)&c->slots, "slots") < 0)
        return -1;
    c->n = (int)n;
    c->me = me;
    c->slot_bytes = slot_bytes;
    c->spin = spin;
    c->futex = HAVE_FUTEX && futex;
    Py_INCREF(progress);
    c->progress = progress;
    Py_INCREF(contiguous);
    c->contiguous = contiguous;
    Py_INCREF(stalled);
    c->stalled = stalled;
    c->stall_ns = 0;
    Py_INCREF(Py_None);
    c->polite = Py_None;
    return 0;
}

static void Core_dealloc(Core *c) {
    PyMem_Free(c->seqs);
    PyMem_Free(c->sleeping);
    PyMem_Free(c->aborts);
    PyMem_Free(c->dones);
    PyMem_Free(c->streams);
    PyMem_Free(c->takes);
    PyMem_Free(c->stores);
    PyMem_Free(c->heads);
    PyMem_Free(c->slots);
    PyMem_Free(c->pids);
    PyMem_Free(c->seg_here);
    PyMem_Free(c->seg_there);
    PyMem_Free(c->scratch);
    Py_XDECREF(c->progress);
    Py_XDECREF(c->contiguous);
    Py_XDECREF(c->stalled);
    Py_XDECREF(c->polite);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int ready(Core *c) {
    if (c->seqs == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Core is not initialised");
        return 0;
    }
    return 1;
}

/* int64 arguments by position, optional ones defaulting to 0 */
static int int_args(PyObject *const *args, Py_ssize_t nargs, const int *at, int count, int64_t *out) {
    for (int i = 0; i < count; i++) {
        out[i] = 0;
        if (at[i] < nargs) {
            out[i] = PyLong_AsLongLong(args[at[i]]);
            if (out[i] == -1 && PyErr_Occurred())
                return -1;
        }
    }
    return 0;
}

/* A method's checks: an initialised core, lo..hi positional arguments (else a TypeError
 * quoting `usage`), and the int64 arguments at positions `at`; 0, or -1 with an exception. */
static int method_args(Core *c, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi,
                       const char *usage, const int *at, int count, int64_t *v) {
    if (!ready(c))
        return -1;
    if (nargs < lo || nargs > hi) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    return int_args(args, nargs, at, count, v);
}

static PyObject *Core_post(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    static const int at[] = {0, 1, 2, 4, 5};
    int64_t v[5];
    if (method_args(c, args, nargs, 3, 6, "post(a, b, c, payload=None, win=0, wout=0)", at, 5, v) < 0)
        return NULL;
    int64_t seq = post(c, v[0], v[1], v[2], nargs > 3 ? args[3] : Py_None, v[3], v[4], c->nt_bytes);
    return seq < 0 ? NULL : PyLong_FromLongLong(seq);
}

static PyObject *Core_wait_posted(Core *c, PyObject *arg) {
    if (!ready(c))
        return NULL;
    int64_t seq = PyLong_AsLongLong(arg);
    if (seq == -1 && PyErr_Occurred())
        return NULL;
    if (wait_posted(c, seq, 0) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_exchange(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    static const int at[] = {0, 1, 2, 5, 6, 7};
    int64_t v[6];
    if (method_args(c, args, nargs, 3, 8, "exchange(a, b, c, payload=None, uneven=False, win=0, wout=0, nbytes=-1)", at,
                    6, v) < 0)
        return NULL;
    int uneven = 0;
    if (nargs > 4 && (uneven = PyObject_IsTrue(args[4])) < 0)
        return NULL;
    int header = nargs > 7 && v[5] >= 0 && v[5] <= HEADER_WAIT_BYTES;
    int64_t seq = exchange(c, v[0], v[1], v[2], nargs > 3 ? args[3] : Py_None, uneven, v[3], v[4], c->nt_bytes, header);
    return seq == 0 ? NULL : PyLong_FromLongLong(seq);
}

static PyObject *Core_stream(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    static const int at[] = {0, 1, 3};
    int64_t v[3];
    if (method_args(c, args, nargs, 4, 5, "stream(seq, root, buf, piece, src=None)", at, 3, v) < 0)
        return NULL;
    int64_t seq = v[0], root = v[1], piece = v[2];
    if (seq < 1 || root < 0 || root >= c->n || piece < 1 || piece > c->slot_bytes) {
        PyErr_SetString(PyExc_ValueError, "stream: an argument is out of range");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[2], &view, PyBUF_C_CONTIGUOUS | (root == c->me ? 0 : PyBUF_WRITABLE)) < 0)
        return NULL;
    int rc = -1, tee = nargs == 5 && args[4] != Py_None && root == c->me;
    Py_buffer from = {0};
    if (tee && PyObject_GetBuffer(args[4], &from, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if ((view.len + piece - 1) / piece >= ((int64_t)1 << STREAM_SHIFT))
        PyErr_SetString(PyExc_ValueError, "stream: too many pieces");
    else if (tee && from.len != view.len)
        PyErr_Format(PyExc_ValueError, "stream: src holds %zd bytes, buf %zd", from.len, view.len);
    else
        rc = stream(c, seq, (int)root, (char *)view.buf, view.len, (Py_ssize_t)piece, tee ? (char *)from.buf : NULL);
    if (tee)
        PyBuffer_Release(&from);
    PyBuffer_Release(&view);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_gather(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    static const int at[] = {0, 3};
    int64_t v[2];
    if (method_args(c, args, nargs, 4, 5, "gather(seq, buf, offsets, piece, src=None)", at, 2, v) < 0)
        return NULL;
    int64_t seq = v[0], piece = v[1];
    if (seq < 1 || piece < 1 || piece > c->slot_bytes) {
        PyErr_SetString(PyExc_ValueError, "gather: an argument is out of range");
        return NULL;
    }
    Py_ssize_t *off;
    if (read_sizes(args[2], c->n + 1, &off, "gather: offsets, ranks + 1 of them") < 0)
        return NULL;
    int rc = -1;
    Py_buffer view, src;
    view.obj = src.obj = NULL;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        view.obj = NULL;
        goto done;
    }
    int ok = off[0] >= 0 && off[c->n] <= view.len;
    for (int r = 0; ok && r < c->n; r++) {
        ok = off[r] <= off[r + 1] && (off[r + 1] - off[r] + piece - 1) / piece < ((int64_t)1 << STREAM_SHIFT);
    }
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "gather: offsets out of range");
        goto done;
    }
    if (nargs > 4 && args[4] != Py_None) {
        if (PyObject_GetBuffer(args[4], &src, PyBUF_C_CONTIGUOUS) < 0) {
            src.obj = NULL;
            goto done;
        }
        if (src.len != off[c->me + 1] - off[c->me]) {
            PyErr_SetString(PyExc_ValueError, "gather: src must hold this rank's block");
            goto done;
        }
    }
    rc = gather_stream(c, seq, (char *)view.buf, off, (Py_ssize_t)piece, src.obj ? (const char *)src.buf : NULL);
done:
    if (src.obj != NULL)
        PyBuffer_Release(&src);
    if (view.obj != NULL)
        PyBuffer_Release(&view);
    PyMem_Free(off);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_has_kernel(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    (void)c;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "has_kernel(dtype, op)");
        return NULL;
    }
    long d = PyLong_AsLong(args[0]), o = PyLong_AsLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    int itemsize;
    return PyBool_FromLong(kernel_for((int)d, (int)o, &itemsize) != NULL);
}

static PyObject *Core_get_polite(Core *c, void *closure) {
    (void)closure;
    Py_INCREF(c->polite ? c->polite : Py_None);
    return c->polite ? c->polite : Py_None;
}

static int Core_set_polite(Core *c, PyObject *v, void *closure) {
    (void)closure;
    if (v == NULL)
        v = Py_None;
    if (v != Py_None && !PyCallable_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "polite must be None or callable");
        return -1;
    }
    Py_INCREF(v);
    Py_XSETREF(c->polite, v);
    return 0;
}

static PyObject *Core_get_spin(Core *c, void *closure) {
    (void)closure;
    return PyLong_FromLong(c->spin);
}

static int Core_set_spin(Core *c, PyObject *v, void *closure) {
    (void)closure;
    long s = v == NULL ? -1 : PyLong_AsLong(v);
    if (s == -1 && (v == NULL || PyErr_Occurred())) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "spin cannot be deleted");
        return -1;
    }
    c->spin = s;
    return 0;
}

/* The byte thresholds (nontemporal, nontemporal_broadcast, nontemporal_out): one getter and
 * one setter, the closure being the field's offset in Core. */
static PyObject *Core_get_bytes(Core *c, void *closure) {
    return PyLong_FromSsize_t(*(Py_ssize_t *)((char *)c + (size_t)closure));
}

static int Core_set_bytes(Core *c, PyObject *v, void *closure) {
    Py_ssize_t b = v == NULL ? -1 : PyLong_AsSsize_t(v);
    if (b < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a byte count >= 0 (0: never)");
        return -1;
    }
    *(Py_ssize_t *)((char *)c + (size_t)closure) = b;
    return 0;
}

/* core.put(dst, src): src's bytes into the shared buffer dst (both C-contiguous, as long);
 * core.put(dst, src, total): out of the shared buffer src into dst, a piece of a message of
 * `total` bytes (copy_out) */
static PyObject *Core_put(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t total = -1;
    if (nargs == 3 && (total = PyLong_AsSsize_t(args[2])) < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "put: total must be >= 0");
    if (PyErr_Occurred())
        return NULL;
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "put(dst, src, total=None)");
        return NULL;
    }
    Py_buffer dst, src;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *res = NULL;
    if (dst.len != src.len)
        PyErr_Format(PyExc_ValueError, "put: %zd bytes into %zd", src.len, dst.len);
    else {
        if (total < 0)
            copy_shared(c, dst.buf, src.buf, (size_t)src.len, c->nt_bytes, STAGED);
        else
            copy_out(c, dst.buf, src.buf, (size_t)src.len, total);
        res = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return res;
}

/* core.single_copy(pids, nbytes, broadcasts): every rank's process id, and the size per rank
 * from which allgathers, and broadcasts, read the sender's memory (0: never); the caller
 * has agreed them */
static PyObject *Core_single_copy(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    if (!ready(c))
        return NULL;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "single_copy(pids, nbytes, broadcasts)");
        return NULL;
    }
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[1]), bcast = PyLong_AsSsize_t(args[2]);
    if (nbytes < 0 || bcast < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "single_copy: sizes must be >= 0");
        return NULL;
    }
    Py_ssize_t *pids;
    if (read_sizes(args[0], c->n, &pids, "single_copy: pids, one per rank") < 0)
        return NULL;
    PyMem_Free(c->pids);
    c->pids = pids;
    c->cma_bytes = nbytes;
    c->cma_bcast = bcast;
    Py_RETURN_NONE;
}

/* core.segments(here, there, nbytes): where every rank's segment of the node's arena is
 * mapped in this process and where it lies in that rank's own, each nbytes long (0: none);
 * moves with a peer whose bytes lie in its segment then copy through the mapping */
static PyObject *Core_segments(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    if (!ready(c))
        return NULL;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "segments(here, there, nbytes)");
        return NULL;
    }
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[2]);
    if (nbytes < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "segments: nbytes must be >= 0");
        return NULL;
    }
    char **here = NULL;
    Py_ssize_t *there = NULL;
    if (nbytes > 0 && (read_addrs(args[0], c->n, (void ***)&here, "segments: here, one per rank") < 0 ||
                       read_sizes(args[1], c->n, &there, "segments: there, one per rank") < 0)) {
        PyMem_Free(here);
        return NULL;
    }
    PyMem_Free(c->seg_here);
    PyMem_Free(c->seg_there);
    c->seg_here = here;
    c->seg_there = (uintptr_t *)there;
    c->seg_bytes = nbytes;
    Py_RETURN_NONE;
}

/* core.cma_read(pid, address, buf) and core.cma_write(pid, address, buf): fill buf with the
 * bytes at `address` in process pid, or write buf's bytes there */
static PyObject *cma_method(PyObject *const *args, Py_ssize_t nargs, int write) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, write ? "cma_write(pid, address, buf)" : "cma_read(pid, address, buf)");
        return NULL;
    }
    long long pid = PyLong_AsLongLong(args[0]);
    unsigned long long addr = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[2], &view, write ? PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    int rc = cma_move((pid_t)pid, (char *)view.buf, (uintptr_t)addr, (size_t)view.len, write);
    PyBuffer_Release(&view);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_cma_read(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    (void)c;
    return cma_method(args, nargs, 0);
}

static PyObject *Core_cma_write(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    (void)c;
    return cma_method(args, nargs, 1);
}

/* The buffers of a reduction read by single copy: s C-contiguous, o C-contiguous and
 * writable (release both); 0, or -1 with an exception set and neither held. */
static int src_and_out(PyObject *s, PyObject *o, Py_buffer *src, Py_buffer *out) {
    if (PyObject_GetBuffer(s, src, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (PyObject_GetBuffer(o, out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(src);
        return -1;
    }
    return 0;
}

/* core.reduce_scatter(seq, src, lo, hi, out, dtype, op, vote): the agreed reduce-scatter seq
 * read by single copy where every rank votes for it (single_copy_reduce_scatter): True, or
 * False where a rank voted against it */
static PyObject *Core_reduce_scatter(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    static const int at[] = {0, 2, 3, 5, 6, 7};
    int64_t v[6];
    if (method_args(c, args, nargs, 8, 8, "reduce_scatter(seq, src, lo, hi, out, dtype, op, vote)", at, 6, v) < 0)
        return NULL;
    int itemsize = 0;
    kernel k = kernel_for((int)v[3], (int)v[4], &itemsize);
    if (k == NULL) {
        PyErr_SetString(PyExc_ValueError, "reduce_scatter: no compiled kernel reduces this dtype with this op");
        return NULL;
    }
    Py_buffer src, out;
    if (src_and_out(args[1], args[4], &src, &out) < 0)
        return NULL;
    int64_t seq = v[0], lo = v[1], hi = v[2];
    int rc = -1;
    if (seq < 1 || lo < 0 || hi < lo || hi > src.len || lo % itemsize || hi % itemsize || out.len != hi - lo)
        PyErr_SetString(PyExc_ValueError, "reduce_scatter: an argument is out of range");
    else if (c->cma_bytes <= 0 || c->pids == NULL)
        PyErr_SetString(PyExc_RuntimeError, "reduce_scatter: single copy is off");
    else
        rc = single_copy_reduce_scatter(c, seq, (const char *)src.buf, lo, hi, (char *)out.buf, v[5] != 0, k,
                                        (int)v[4], itemsize);
    PyBuffer_Release(&out);
    PyBuffer_Release(&src);
    if (rc < 0)
        return NULL;
    return PyBool_FromLong(rc);
}

static PyObject *Core_allreduce(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    static const int at[] = {0, 3, 4, 5};
    int64_t v[4];
    if (method_args(c, args, nargs, 6, 6, "allreduce(seq, src, out, dtype, op, vote)", at, 4, v) < 0)
        return NULL;
    int itemsize = 0;
    kernel k = kernel_for((int)v[1], (int)v[2], &itemsize);
    if (k == NULL)
        Py_RETURN_FALSE;
    Py_buffer src, out;
    if (src_and_out(args[1], args[2], &src, &out) < 0)
        return NULL;
    const char *x = (const char *)src.buf, *o = (const char *)out.buf;
    int rc = -1;
    if (v[0] < 1 || out.len != src.len || src.len % itemsize || (v[3] && o < x + src.len && x < o + out.len))
        PyErr_SetString(PyExc_ValueError, "allreduce: an argument is out of range, or out overlaps src");
    else if (c->cma_bytes <= 0 || c->pids == NULL)
        PyErr_SetString(PyExc_RuntimeError, "allreduce: single copy is off");
    else
        rc = single_copy_allreduce(c, v[0], x, (char *)out.buf, src.len, v[3] != 0, k, (int)v[2], itemsize);
    PyBuffer_Release(&out);
    PyBuffer_Release(&src);
    if (rc < 0)
        return NULL;
    return PyBool_FromLong(rc);
}

static PyObject *Core_get_stall(Core *c, void *closure) {
    (void)closure;
    return PyFloat_FromDouble((double)c->stall_ns / 1e9);
}

static int Core_set_stall(Core *c, PyObject *v, void *closure) {
    (void)closure;
    double s = v == NULL ? -1.0 : PyFloat_AsDouble(v);
    if (s == -1.0 && (v == NULL || PyErr_Occurred())) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "stall cannot be deleted");
        return -1;
    }
    c->stall_ns = s > 0 ? (int64_t)(s * 1e9) : 0;
    return 0;
}

/* -- one-step calls ------------------------------------------------------------------------
 * A Step is one collective's one-step call for one (dtype, shape, op or root), built once:
 * step(x, out=None) checks out as the Python one-step functions do (an ndarray of the
 * result's shape and dtype, C-contiguous and writable; otherwise it returns `slow` having
 * posted nothing), posts x, waits, checks the peers' signatures (`mismatch` when they
 * differ; for allgather `uneven` when a peer's rows or out differ from ours) and finishes
 * the call from the slots, returning the result. */
enum { STEP_REDUCE = 0, STEP_BROADCAST = 1, STEP_ALLGATHER = 2 };
#define STEP_MAXDIM 64

typedef struct {
    PyObject_HEAD vectorcallfunc vectorcall;
    Core *core;
    int kind, op, root, ndim;
    int64_t a, b, c, fits;
    kernel k;
    Py_ssize_t itemsize, lo, hi, nbytes, out_bytes;
    Py_ssize_t second; /* the second step: a reduction's split_at, a broadcast's stream piece, an allgather's
                          single copy (1) (0: one step) */
    Py_ssize_t shape[STEP_MAXDIM];
    char fmt[16];
    PyObject *ndarray, *shape_obj, *dtype, *empty, *slow, *mismatch, *uneven;
} Step;

static PyTypeObject StepType;

/* out as a writable C-contiguous buffer of the result's shape and dtype: 1 (view filled),
 * or 0 (no exception) when it is not exactly that. */
static int out_fits(Step *s, PyObject *out, Py_buffer *view) {
    if ((PyObject *)Py_TYPE(out) != s->ndarray)
        return 0;
    if (PyObject_GetBuffer(out, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    int ok = view->ndim == s->ndim && view->itemsize == s->itemsize && view->format != NULL &&
             strcmp(view->format, s->fmt) == 0;
    for (int i = 0; ok && i < s->ndim; i++) ok = view->shape[i] == s->shape[i];
    if (!ok)
        PyBuffer_Release(view);
    return ok;
}

/* a new result array and its buffer; NULL with an exception set */
static PyObject *new_out(Step *s, Py_buffer *view) {
    PyObject *args[2] = {s->shape_obj, s->dtype};
    PyObject *out = PyObject_Vectorcall(s->empty, args, 2, NULL);
    if (out == NULL)
        return NULL;
    if (PyObject_GetBuffer(out, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* Finish a posted allreduce (or reduce) in two steps: this rank's block, reduced over every
 * rank's slot in rank order, into its own slot at s->second (past the data the peers still
 * read); its dones word published; then, on a rank that takes the result (every rank of an
 * allreduce, a reduce's root), once every peer's is, every block copied into out. Each
 * rank reads count elements and one block from each slot, where one step reads n * count.
 * 0, or -1 with an exception set. */
static int split_reduce(Step *s, int64_t seq, char *out) {
    Core *c = s->core;
    int n = c->n, p = (int)(seq & 1);
    Py_ssize_t count = s->hi, isz = s->itemsize;
    Py_ssize_t lo = block_start(count, n, c->me), hi = block_start(count, n, c->me + 1);
    if (reduce_slots(c, seq, s->k, s->op, isz, lo, hi, c->slots[2 * c->me + p] + s->second + lo * isz, s->nbytes) <
        0)
        return -1;
    publish(c, c->dones[c->me], seq);
    if (s->root >= 0 && s->root != c->me)
        return 0;
    if (wait_all(c, c->dones, seq, 4) < 0)
        return -1;
    for (int r = 0; r < n; r++) {
        Py_ssize_t a = block_start(count, n, r), z = block_start(count, n, r + 1);
        memcpy(out + a * isz, c->slots[2 * r + p] + s->second + a * isz, (size_t)((z - a) * isz));
    }
    return 0;
}

/* Finish an agreed one-step allgather of equal blocks by single_copy_allgather: this rank's
 * block is x (any layout: a C-contiguous copy where it is not), the peers read it there.
 * 0, or -1 with an exception set. */
static int gather_single(Step *s, int64_t seq, PyObject *x, char *out) {
    Core *c = s->core;
    Py_buffer view;
    PyObject *held;
    if (contiguous_view(c, x, &view, &held) < 0)
        return -1;
    int rc = -1;
    Py_ssize_t *off = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(c->n + 1));
    if (off == NULL)
        PyErr_NoMemory();
    else if (view.len != s->nbytes)
        PyErr_SetString(PyExc_ValueError, "allgather: x does not hold the agreed bytes");
    else {
        for (int r = 0; r <= c->n; r++) off[r] = r * s->nbytes;
        rc = single_copy_allgather(c, seq, out, off, (const char *)view.buf);
    }
    PyMem_Free(off);
    PyBuffer_Release(&view);
    Py_XDECREF(held);
    return rc;
}

/* Finish an agreed streamed broadcast into out: on the root, x (any layout: a C-contiguous
 * copy where it is not; NULL where out is x) holds the data, which goes into out and to the
 * others, through its slot or read where it lies by single copy. 0, or -1 with an
 * exception set. */
static int streamed_broadcast(Step *s, int64_t seq, PyObject *x, char *out) {
    Core *c = s->core;
    if (x == NULL)
        return stream(c, seq, s->root, out, s->nbytes, s->second, NULL);
    Py_buffer view;
    PyObject *held;
    if (contiguous_view(c, x, &view, &held) < 0)
        return -1;
    int rc = -1;
    if (view.len != s->nbytes)
        PyErr_SetString(PyExc_ValueError, "broadcast: x does not hold the agreed bytes");
    else
        rc = stream(c, seq, s->root, out, s->nbytes, s->second, (const char *)view.buf);
    PyBuffer_Release(&view);
    Py_XDECREF(held);
    return rc;
}

static PyObject *Step_call(Step *s, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1 || nargs > 2 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "step(x, out=None)");
        return NULL;
    }
    Core *c = s->core;
    PyObject *x = args[0], *out = nargs > 1 ? args[1] : Py_None, *res = NULL;
    int mine = s->kind != STEP_REDUCE || s->root < 0 || s->root == c->me;
    Py_buffer view;
    int have = 0;
    int64_t b = s->b;
    if (out != Py_None) {
        if (!out_fits(s, out, &view))
            return Py_NewRef(s->slow);
        have = 1;
        Py_INCREF(out);
        if (s->kind == STEP_ALLGATHER)
            b = s->fits;
    } else if (mine && s->kind != STEP_ALLGATHER) {
        if ((out = new_out(s, &view)) == NULL)
            return NULL;
        have = 1;
    }
    int is_root = s->kind == STEP_BROADCAST && s->root == c->me;
    int streamed = s->kind == STEP_BROADCAST && s->second;
    int single = s->kind == STEP_ALLGATHER && s->second; /* each rank reads the others' x, not the slots */
    PyObject *payload = (s->kind == STEP_BROADCAST && (!is_root || streamed)) || single ? Py_None : x;
    int header = (s->kind == STEP_BROADCAST && !streamed) || s->nbytes <= HEADER_WAIT_BYTES; /* wait_posted */
    int64_t seq =
        exchange(c, s->a, b, s->c, payload, s->kind == STEP_ALLGATHER, 0, 0, is_root ? c->nt_bcast : c->nt_bytes,
                 header);
    if (seq == 0)
        goto done;
    if (seq < 0) {
        res = Py_NewRef(s->mismatch);
        goto done;
    }
    int p = (int)(seq & 1);
    if (s->kind == STEP_REDUCE) {
        if (s->second ? split_reduce(s, seq, (char *)view.buf) < 0
                      : mine && reduce_slots(c, seq, s->k, s->op, s->itemsize, s->lo, s->hi, (char *)view.buf,
                                             s->nbytes) < 0)
            goto done;
    } else if (streamed) { /* the root's data from x, through its slot or read by the others */
        if (streamed_broadcast(s, seq, is_root && out != x ? x : NULL, (char *)view.buf) < 0)
            goto done;
    } else if (s->kind == STEP_BROADCAST) {
        if (!is_root || out != x)
            memcpy(view.buf, slot_data(c, s->root, p, s->nbytes), (size_t)s->nbytes);
    } else {
        for (int r = 0; r < c->n; r++) {
            int64_t w = c->heads[2 * r + p][1];
            if (r != c->me && w != s->b && w != s->fits) {
                res = Py_NewRef(s->uneven);
                goto done;
            }
        }
        if (!have) {
            if ((out = new_out(s, &view)) == NULL)
                goto done;
            have = 1;
        }
        if (single) {
            if (gather_single(s, seq, x, (char *)view.buf) < 0)
                goto done;
        } else {
            for (int r = 0; r < c->n; r++)
                memcpy((char *)view.buf + r * s->nbytes, slot_data(c, r, p, s->nbytes), (size_t)s->nbytes);
        }
    }
    res = mine ? Py_NewRef(out) : Py_NewRef(Py_None);
done:
    if (have) {
        PyBuffer_Release(&view);
        Py_DECREF(out);
    }
    return res;
}

static void Step_dealloc(Step *s) {
    Py_XDECREF(s->core);
    Py_XDECREF(s->ndarray);
    Py_XDECREF(s->shape_obj);
    Py_XDECREF(s->dtype);
    Py_XDECREF(s->empty);
    Py_XDECREF(s->slow);
    Py_XDECREF(s->mismatch);
    Py_XDECREF(s->uneven);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* core.step(kind, a, b, c, fits, like, dtype, op, lo, hi, root, nbytes, empty, slow, mismatch, uneven,
 *           second=0): nbytes, the bytes each rank posts (a reduction's whole input, of which
 *           it takes elements lo to hi; an allgather's block; a broadcast's message) */
static PyObject *Core_step(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    static const int at[] = {0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 16};
    int64_t v[12];
    if (method_args(c, args, nargs, 16, 17,
                    "step(kind, a, b, c, fits, like, dtype, op, lo, hi, root, nbytes, empty, slow, mismatch, uneven, "
                    "second=0)",
                    at, 12, v) < 0)
        return NULL;
    int64_t kind = v[0], lo = v[7], hi = v[8], root = v[9], nbytes = v[10], second = v[11];
    PyObject *like = args[5];
    Py_buffer view;
    if (PyObject_GetBuffer(like, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL; /* e.g. bfloat16, which has no buffer format: the caller keeps Python's loop */
    if (view.ndim > STEP_MAXDIM || view.format == NULL || strlen(view.format) >= 16 || kind < STEP_REDUCE ||
        kind > STEP_ALLGATHER || nbytes < 0 || root >= c->n || second < 0 ||
        (nbytes > c->slot_bytes && !(second && kind == STEP_ALLGATHER)) ||
        (second && kind == STEP_ALLGATHER && (c->cma_bytes <= 0 || nbytes < c->cma_bytes)) ||
        (second && kind == STEP_BROADCAST && second > c->slot_bytes)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "step: an argument is out of range");
        return NULL;
    }
    Step *s = PyObject_New(Step, &StepType);
    if (s == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    s->vectorcall = (vectorcallfunc)Step_call;
    s->kind = (int)kind;
    s->a = v[1];
    s->b = v[2];
    s->c = v[3];
    s->fits = v[4];
    s->root = (int)root;
    s->lo = (Py_ssize_t)lo;
    s->hi = (Py_ssize_t)hi;
    s->nbytes = (Py_ssize_t)nbytes;
    s->second = (Py_ssize_t)second;
    s->ndim = view.ndim;
    s->itemsize = view.itemsize;
    s->out_bytes = view.len;
    for (int i = 0; i < view.ndim; i++) s->shape[i] = view.shape[i];
    strcpy(s->fmt, view.format);
    PyBuffer_Release(&view);
    s->k = NULL;
    s->op = (int)v[6];
    if (kind == STEP_REDUCE) {
        int itemsize = 0;
        s->k = kernel_for((int)v[5], (int)v[6], &itemsize);
        int bad_split = second && (lo != 0 || c->n < 2 || second % itemsize || nbytes <= HEAD_DATA ||
                                   second < hi * itemsize || second + hi * itemsize > c->slot_bytes);
        if (s->k == NULL || itemsize != s->itemsize || lo < 0 || hi < lo || hi * itemsize > nbytes ||
            (hi - lo) * itemsize != s->out_bytes || bad_split) {
            s->core = NULL;
            s->ndarray = s->shape_obj = s->dtype = s->empty = s->slow = s->mismatch = s->uneven = NULL;
            Py_DECREF(s);
            PyErr_SetString(PyExc_ValueError, "step: no kernel for this dtype and op, or a bad range");
            return NULL;
        }
    }
    s->core = (Core *)Py_NewRef((PyObject *)c);
    s->ndarray = Py_NewRef((PyObject *)Py_TYPE(like));
    s->shape_obj = PyObject_GetAttrString(like, "shape");
    s->dtype = PyObject_GetAttrString(like, "dtype");
    s->empty = Py_NewRef(args[12]);
    s->slow = Py_NewRef(args[13]);
    s->mismatch = Py_NewRef(args[14]);
    s->uneven = Py_NewRef(args[15]);
    if (s->shape_obj == NULL || s->dtype == NULL) {
        Py_DECREF(s);
        return NULL;
    }
    return (PyObject *)s;
}

static PyTypeObject StepType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "collectives.cslots.Step",
    .tp_basicsize = sizeof(Step),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "One collective's one-step call, compiled: step(x, out=None).",
    .tp_vectorcall_offset = offsetof(Step, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)Step_dealloc,
};

/* core.note_stores(plain, nt, staged=False): one probe's two times, as a copy's probe notes them */
static PyObject *Core_note_stores(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    if (!ready(c))
        return NULL;
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "note_stores(plain, nt, staged=False)");
        return NULL;
    }
    double plain = PyFloat_AsDouble(args[0]), nt = PyFloat_AsDouble(args[1]);
    if (PyErr_Occurred())
        return NULL;
    int staged = nargs == 3 ? PyObject_IsTrue(args[2]) : 0;
    if (staged < 0)
        return NULL;
    note_probe(c, staged ? STAGED : SLOTS, plain, nt);
    Py_RETURN_NONE;
}

static PyMethodDef Core_methods[] = {
    {"post", (PyCFunction)(void (*)(void))Core_post, METH_FASTCALL,
     "post(a, b, c, payload=None, win=0, wout=0) -> seq: publish this rank's next call."},
    {"wait_posted", (PyCFunction)Core_wait_posted, METH_O, "wait_posted(seq): wait until every peer has posted seq."},
    {"exchange", (PyCFunction)(void (*)(void))Core_exchange, METH_FASTCALL,
     "exchange(a, b, c, payload=None, uneven=False, win=0, wout=0) -> seq, or -seq when signatures differ."},
    {"step", (PyCFunction)(void (*)(void))Core_step, METH_FASTCALL,
     "step(kind, a, b, c, fits, like, dtype, op, lo, hi, root, nbytes, empty, slow, mismatch, uneven, second=0) "
     "-> Step: one collective's one-step call (kind 0: reduce into lo..hi on root, or on every rank when root < 0; "
     "1: broadcast from root; 2: allgather), like: an array shaped as its result; second: a reduction's "
     "reduced blocks go to this byte offset of each slot, in two steps; a broadcast streams through the root's "
     "slot in pieces of this many bytes once agreed; an allgather (1) reads the peers' x with cross-memory attach, "
     "from single_copy's size (0: one step)."},
    {"gather", (PyCFunction)(void (*)(void))Core_gather, METH_FASTCALL,
     "gather(seq, buf, offsets, piece, src=None): fill every rank's bytes offsets[r]..offsets[r + 1] of buf from "
     "rank r's, through the ranks' slots, `piece` bytes at a time (the agreed allgather `seq`); this rank's block "
     "is src where given (copied into buf as it goes), else already in buf."},
    {"stream", (PyCFunction)(void (*)(void))Core_stream, METH_FASTCALL,
     "stream(seq, root, buf, piece, src=None): move the agreed broadcast `seq` from root's buf into every other "
     "rank's through root's slot, `piece` bytes at a time, or read from root's memory from the single-copy size; "
     "on root, src (C-contiguous, as many bytes) is its data where given, copied into buf as it goes."},
    {"single_copy", (PyCFunction)(void (*)(void))Core_single_copy, METH_FASTCALL,
     "single_copy(pids, nbytes, broadcasts): every rank's process id, and the bytes per rank from which agreed "
     "allgathers, and broadcasts, read the sender's memory with cross-memory attach (0: never); the same on every "
     "rank."},
    {"reduce_scatter", (PyCFunction)(void (*)(void))Core_reduce_scatter, METH_FASTCALL,
     "reduce_scatter(seq, src, lo, hi, out, dtype, op, vote) -> bool: the agreed reduce-scatter `seq` by single copy, "
     "where every rank votes for it: this rank's block, bytes lo to hi of every rank's C-contiguous src, read from the "
     "peers' memory and reduced in rank order into out; False, having done nothing more than agree, where a rank voted "
     "against it. ValueError where numpy must reduce the dtype and op (has_kernel)."},
    {"allreduce", (PyCFunction)(void (*)(void))Core_allreduce, METH_FASTCALL,
     "allreduce(seq, src, out, dtype, op, vote) -> bool: the agreed allreduce `seq` of every rank's C-contiguous "
     "src into out (as long, not overlapping src where it votes) by single copy, where every rank votes for it: "
     "each rank's block read from the peers' src and reduced in rank order into its out, then the peers' blocks "
     "read from their out; False, having done nothing more than agree, where a rank voted against it, and having "
     "done nothing, where numpy must reduce the dtype and op."},
    {"segments", (PyCFunction)(void (*)(void))Core_segments, METH_FASTCALL,
     "segments(here, there, nbytes): where every rank's segment of the node's arena is mapped here and where it "
     "lies in that rank's process, nbytes each (0: none); a move with a peer whose bytes lie in its segment copies "
     "through the mapping, where cross-memory attach would pin its shared pages one by one."},
    {"cma_read", (PyCFunction)(void (*)(void))Core_cma_read, METH_FASTCALL,
     "cma_read(pid, address, buf): fill buf with the bytes at address in process pid (process_vm_readv); "
     "OSError where the kernel refuses."},
    {"cma_write", (PyCFunction)(void (*)(void))Core_cma_write, METH_FASTCALL,
     "cma_write(pid, address, buf): write buf's bytes at address in process pid (process_vm_writev); "
     "OSError where the kernel refuses."},
    {"put", (PyCFunction)(void (*)(void))Core_put, METH_FASTCALL,
     "put(dst, src, total=None): copy src's bytes into the shared buffer dst (C-contiguous, as long), with "
     "non-temporal stores from `nontemporal` bytes; given `total`, out of the shared buffer src into a piece of "
     "a message of `total` bytes, with non-temporal stores once it reaches `nontemporal_out`."},
    {"note_stores", (PyCFunction)(void (*)(void))Core_note_stores, METH_FASTCALL,
     "note_stores(plain, nt, staged=False): note one probe's times of plain and of non-temporal stores into the "
     "slots (staged: the chunk buffers), as a measured copy does (0 for either: only take the ranks' calls "
     "again)."},
    {"has_kernel", (PyCFunction)(void (*)(void))Core_has_kernel, METH_FASTCALL,
     "has_kernel(dtype, op) -> bool: reduce takes this dtype code and op code."},
    {NULL, NULL, 0, NULL}};

static PyObject *Core_get_measured(Core *c, void *closure) {
    (void)closure;
    return PyBool_FromLong(c->measured);
}

static int Core_set_measured(Core *c, PyObject *v, void *closure) {
    (void)closure;
    int on = v == NULL ? -1 : PyObject_IsTrue(v);
    if (on < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "measured cannot be deleted");
        return -1;
    }
    c->measured = on;
    return 0;
}

/* core.stores, core.staged_stores: what one kind's measured copies use, its ratio and probes */
static PyObject *Core_get_stores(Core *c, void *closure) {
    const Stores *st = &c->kinds[closure == NULL ? SLOTS : STAGED];
    return Py_BuildValue("(Ndn)", PyBool_FromLong(c->measured && st->nt), exp(st->log_ratio), (Py_ssize_t)st->probes);
}

static PyObject *Core_get_mapped(Core *c, void *closure) {
    (void)closure;
    return PyLong_FromLongLong((long long)c->mapped_bytes);
}

static PyObject *Core_get_offers(Core *c, void *closure) {
    (void)closure;
    const Offers *o = &c->offers;
    return Py_BuildValue("(NdLL)", PyBool_FromLong(o->block), o->trip_ns, (long long)o->checks, (long long)o->calls);
}

static PyObject *Core_get_waits(Core *c, void *closure) {
    (void)closure;
    return Py_BuildValue("(LLLL)", (long long)c->waits[0], (long long)c->waits[1], (long long)c->waits[2],
                         (long long)c->waits[3]);
}

static PyGetSetDef Core_getset[] = {
    {"waits", (getter)Core_get_waits, NULL,
     "(waits, polls, sleeps, wakes): since the core was made, the waits for a peer's counter that found it behind, "
     "the polls they made, the sleeps they took (a futex wait or a nanosleep each), and the futex wake-ups this rank "
     "sent to sleeping peers. Their differences around a run of calls tell where its waiting went.",
     NULL},
    {"offers", (getter)Core_get_offers, NULL,
     "(block, round trip ns, checks, calls): whether an allgather by single copy of 2 ranks with an output from 4 MiB "
     "that stays in the caches now offers its own block of the output (else its source), the round trip to the other "
     "rank that decided it (0: none timed), how many were timed, and how many such calls there were.",
     NULL},
    {"mapped", (getter)Core_get_mapped, NULL,
     "Bytes the single-copy moves copied through a peer's arena segment mapped here (core.segments), not by "
     "cross-memory attach.",
     NULL},
    {"measured", (getter)Core_get_measured, (setter)Core_set_measured,
     "Copies into shared memory below `nontemporal` choose plain or non-temporal stores by measuring them.", NULL},
    {"stores", (getter)Core_get_stores, NULL,
     "(non-temporal, ratio, probes): what measured copies into the slots use now, a plain store's time over a "
     "non-temporal one's (the median of the last three probes), and the probes made.",
     NULL},
    {"staged_stores", (getter)Core_get_stores, NULL,
     "(non-temporal, ratio, probes): the same for the chunk buffers that chunked calls stage through (put).",
     (void *)"staged"},
    {"polite", (getter)Core_get_polite, (setter)Core_set_polite,
     "None, or a callable: while it returns True, waits poll briefly before sleeping.", NULL},
    {"spin", (getter)Core_get_spin, (setter)Core_set_spin, "Polls (of the Python loop's length) before sleeping.",
     NULL},
    {"nontemporal", (getter)Core_get_bytes, (setter)Core_set_bytes,
     "Copies into shared memory of at least this many bytes use non-temporal stores (0: never).",
     (void *)offsetof(Core, nt_bytes)},
    {"nontemporal_broadcast", (getter)Core_get_bytes, (setter)Core_set_bytes,
     "A broadcast root's copies into shared memory of at least this many bytes use non-temporal stores (0: never).",
     (void *)offsetof(Core, nt_bcast)},
    {"nontemporal_out", (getter)Core_get_bytes, (setter)Core_set_bytes,
     "Copies out of shared memory into messages of at least this many bytes use non-temporal stores (0: never).",
     (void *)offsetof(Core, out_nt_bytes)},
    {"stall", (getter)Core_get_stall, (setter)Core_set_stall,
     "Seconds a wait for one peer lasts before it ends in a stall error (0: never).", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "collectives.cslots.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A node channel's post/poll loop on its shared window (see the module docstring).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
};

/* A public collective's front door, compiled: path(x, arg, algorithm, out, comm, agreed)
 * runs the call through the one-step function that lookup(name, x, arg, algorithm, comm)
 * gives for it (False: none), and hands it to general(x, arg, algorithm, out, comm, agreed,
 * why) where there is none, x is not an ndarray, or the function returned slow, mismatch or
 * uneven (why: that result, or slow). It remembers the last call's communicator, dtype, shape, arg and
 * algorithm with their function, so that a call like the last one skips the lookup: equal
 * by identity or ==, as a dict key's parts are. forget() drops what every path remembers,
 * as a context's channel goes away. */
typedef struct Path {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *name, *lookup, *general, *ndarray, *slow, *mismatch, *uneven;
    /* the remembered call, NULL when none */
    PyObject *comm, *dtype, *shape, *arg, *algorithm, *fn;
    struct Path *next; /* every live path, for forget() */
} Path;

static Path *paths = NULL;
static PyObject *str_dtype = NULL, *str_shape = NULL;

static void Path_forget(Path *p) {
    PyObject *old[6] = {p->comm, p->dtype, p->shape, p->arg, p->algorithm, p->fn};
    p->comm = p->dtype = p->shape = p->arg = p->algorithm = p->fn = NULL;
    for (int i = 0; i < 6; i++) Py_XDECREF(old[i]); /* last: a decref may run Python code */
}

/* a and b are equal as a dict compares keys; 0 where they are not or cannot be compared */
static int same(PyObject *a, PyObject *b) {
    if (a == b)
        return 1;
    int eq = PyObject_RichCompareBool(a, b, Py_EQ);
    if (eq < 0) {
        PyErr_Clear();
        return 0;
    }
    return eq;
}

static PyObject *Path_general(Path *p, PyObject *const *args, PyObject *why) {
    PyObject *call[7] = {args[0], args[1], args[2], args[3], args[4], args[5], why};
    return PyObject_Vectorcall(p->general, call, 7, NULL);
}

static PyObject *Path_call(Path *p, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 6 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "path(x, arg, algorithm, out, comm, agreed)");
        return NULL;
    }
    PyObject *x = args[0], *arg = args[1], *algorithm = args[2], *out = args[3], *comm = args[4];
    if ((PyObject *)Py_TYPE(x) != p->ndarray)
        return Path_general(p, args, p->slow);
    PyObject *dtype = PyObject_GetAttr(x, str_dtype);
    PyObject *shape = dtype == NULL ? NULL : PyObject_GetAttr(x, str_shape);
    if (shape == NULL) {
        Py_XDECREF(dtype);
        return NULL;
    }
    PyObject *fn = NULL;
    if (p->fn != NULL && comm == p->comm) {
        /* held while compared: an __eq__ may run Python code that changes what p remembers */
        PyObject *m[5] = {p->dtype, p->shape, p->arg, p->algorithm, p->fn};
        for (int i = 0; i < 5; i++) Py_INCREF(m[i]);
        if (same(dtype, m[0]) && same(shape, m[1]) && same(arg, m[2]) && same(algorithm, m[3]))
            fn = Py_NewRef(m[4]);
        for (int i = 0; i < 5; i++) Py_DECREF(m[i]);
    }
    if (fn != NULL) {
        Py_DECREF(dtype);
        Py_DECREF(shape);
    } else {
        PyObject *look[5] = {p->name, x, arg, algorithm, comm};
        fn = PyObject_Vectorcall(p->lookup, look, 5, NULL);
        if (fn == NULL) {
            Py_DECREF(dtype);
            Py_DECREF(shape);
            return NULL;
        }
        PyObject *old[6] = {p->comm, p->dtype, p->shape, p->arg, p->algorithm, p->fn};
        p->comm = Py_NewRef(comm);
        p->dtype = dtype;
        p->shape = shape;
        p->arg = Py_NewRef(arg);
        p->algorithm = Py_NewRef(algorithm);
        p->fn = Py_NewRef(fn);
        for (int i = 0; i < 6; i++) Py_XDECREF(old[i]); /* last: a decref may run Python code */
    }
    int truth = PyObject_IsTrue(fn);
    if (truth <= 0) {
        Py_DECREF(fn);
        return truth < 0 ? NULL : Path_general(p, args, p->slow);
    }
    PyObject *call[2] = {x, out};
    PyObject *res = PyObject_Vectorcall(fn, call, out == Py_None ? 1 : 2, NULL);
    Py_DECREF(fn);
    if (res == p->slow || res == p->mismatch || res == p->uneven) {
        PyObject *why = res;
        res = Path_general(p, args, why);
        Py_DECREF(why);
    }
    return res;
}

static void Path_dealloc(Path *p) {
    for (Path **q = &paths; *q != NULL; q = &(*q)->next)
        if (*q == p) {
            *q = p->next;
            break;
        }
    Path_forget(p);
    PyObject *own[7] = {p->name, p->lookup, p->general, p->ndarray, p->slow, p->mismatch, p->uneven};
    for (int i = 0; i < 7; i++) Py_XDECREF(own[i]);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* Path(name, lookup, general, ndarray, slow, mismatch, uneven) */
static PyObject *Path_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *o[7];
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Path() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "Path", 7, 7, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6]))
        return NULL;
    if (!PyCallable_Check(o[1]) || !PyCallable_Check(o[2]) || !PyType_Check(o[3])) {
        PyErr_SetString(PyExc_TypeError, "Path(name, lookup, general, ndarray, slow, mismatch, uneven): "
                                         "lookup and general callables, ndarray a type");
        return NULL;
    }
    Path *p = (Path *)type->tp_alloc(type, 0);
    if (p == NULL)
        return NULL;
    p->vectorcall = (vectorcallfunc)Path_call;
    p->name = Py_NewRef(o[0]);
    p->lookup = Py_NewRef(o[1]);
    p->general = Py_NewRef(o[2]);
    p->ndarray = Py_NewRef(o[3]);
    p->slow = Py_NewRef(o[4]);
    p->mismatch = Py_NewRef(o[5]);
    p->uneven = Py_NewRef(o[6]);
    p->next = paths;
    paths = p;
    return (PyObject *)p;
}

static PyObject *Path_get_remembered(Path *p, void *closure) {
    (void)closure;
    return PyBool_FromLong(p->fn != NULL);
}

static PyGetSetDef Path_getset[] = {
    {"remembered", (getter)Path_get_remembered, NULL, "True while the path remembers a call.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject PathType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "collectives.cslots.Path",
    .tp_basicsize = sizeof(Path),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A public collective's front door, compiled: path(x, arg, algorithm, out, comm, agreed) "
              "(see the module docstring).",
    .tp_vectorcall_offset = offsetof(Path, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = Path_new,
    .tp_dealloc = (destructor)Path_dealloc,
    .tp_getset = Path_getset,
};

/* forget(): every path drops the call it remembers */
static PyObject *forget(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    for (Path *p = paths; p != NULL; p = p->next) Path_forget(p);
    Py_RETURN_NONE;
}

/* address(obj) -> int or None: where obj's buffer starts (its first element, any layout),
 * or None for an object without a buffer (a bfloat16 array: no buffer format) */
static PyObject *address(PyObject *self, PyObject *obj) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_STRIDES) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *res = PyLong_FromVoidPtr(view.buf);
    PyBuffer_Release(&view);
    return res;
}

/* line_round_trip(buf, me, rounds, timeout) -> seconds: one cache line's round trip between
 * two processes that share buf (writable, at least 3 lines, its first word 8-byte aligned, 0
 * on both sides' first call): rank `me` 0 stores i in the first word and waits for i in the
 * word two lines on, which rank 1 stores once it sees i there, for i = 1 .. rounds; the
 * seconds per round trip, as each side timed it. This is the floor under every wait of the
 * node channel: a small call's ranks exchange at least one such line each way. Polls
 * without sleeping, the GIL released: the two must run at once, on cores of their own.
 * TimeoutError where the other side's next answer did not come within about `timeout`
 * seconds. */
static PyObject *line_round_trip(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "line_round_trip(buf, me, rounds, timeout)");
        return NULL;
    }
    long me = PyLong_AsLong(args[1]);
    if (me == -1 && PyErr_Occurred())
        return NULL;
    long long rounds = PyLong_AsLongLong(args[2]);
    if (rounds == -1 && PyErr_Occurred())
        return NULL;
    double timeout = PyFloat_AsDouble(args[3]);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    if ((me != 0 && me != 1) || rounds < 1 || !(timeout > 0)) {
        PyErr_Format(PyExc_ValueError, "line_round_trip: me=%ld must be 0 or 1, rounds=%lld >= 1, timeout > 0", me,
                     rounds);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    if (view.len < 3 * LINE_BYTES || (uintptr_t)view.buf % sizeof(int64_t)) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "line_round_trip: buf must hold %d bytes from an 8-byte boundary",
                     3 * LINE_BYTES);
        return NULL;
    }
    int64_t *ping = (int64_t *)view.buf, *pong = (int64_t *)((char *)view.buf + 2 * LINE_BYTES);
    int64_t *mine = me ? pong : ping, *theirs = me ? ping : pong;
    int64_t start = 0, end = 0, patience = (int64_t)(fmin(timeout, 1e6) * 1e9);
    int late = 0;
    Py_BEGIN_ALLOW_THREADS
    start = now_ns(); /* `timeout` from the other's last answer seen, the clock read every 4096 polls */
    late = line_trips(mine, theirs, me == 0, 1, rounds, start + patience, patience, 4095) < 0;
    end = now_ns();
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (late) {
        char text[96]; /* PyErr_Format has no %f */
        PyOS_snprintf(text, sizeof text, "line_round_trip: the other side did not answer within %.3g s", timeout);
        PyErr_SetString(PyExc_TimeoutError, text);
        return NULL;
    }
    return PyFloat_FromDouble((double)(end - start) * 1e-9 / (double)rounds);
}

static PyMethodDef module_methods[] = {
    {"address", (PyCFunction)address, METH_O,
     "address(obj) -> int or None: where obj's buffer starts; None when it has no buffer."},
    {"forget", (PyCFunction)forget, METH_NOARGS, "forget(): every Path drops the call it remembers."},
    {"line_round_trip", (PyCFunction)(void (*)(void))line_round_trip, METH_FASTCALL,
     "line_round_trip(buf, me, rounds, timeout) -> seconds: a cache line's round trip between two processes "
     "sharing buf (me 0 or 1), as each timed it."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cslots",
    .m_doc = "The node channel's post/poll loop and one-step reductions, compiled.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit_cslots(void) {
    if (PyType_Ready(&CoreType) < 0 || PyType_Ready(&StepType) < 0 || PyType_Ready(&PathType) < 0)
        return NULL;
    if ((str_dtype = PyUnicode_InternFromString("dtype")) == NULL ||
        (str_shape = PyUnicode_InternFromString("shape")) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&PathType);
    if (PyModule_AddObject(m, "Path", (PyObject *)&PathType) < 0) {
        Py_DECREF(&PathType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "FUTEX", HAVE_FUTEX) < 0 || PyModule_AddIntConstant(m, "STREAM_SHIFT", STREAM_SHIFT) < 0 ||
        PyModule_AddIntConstant(m, "REDUCE_PIECE", REDUCE_PIECE) < 0 ||
        PyModule_AddIntConstant(m, "NONTEMPORAL_BYTES", NONTEMPORAL_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "STEP_REDUCE", STEP_REDUCE) < 0 ||
        PyModule_AddIntConstant(m, "STEP_BROADCAST", STEP_BROADCAST) < 0 ||
        PyModule_AddIntConstant(m, "STEP_ALLGATHER", STEP_ALLGATHER) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
