/* The kernels' thread pool (see pool.h for why it is not OpenMP).
 *
 * Workers start on first use, as many as the widest job asked for (less one: the caller works
 * too). A job is published by bumping the generation in `job`; the workers it takes spin for
 * SPIN_NS after each job they ran, then sleep on a condition variable of their own, and the caller
 * wakes the sleepers it needs under the mutex they sleep with, so no wake-up is lost. Tasks are
 * handed out by an atomic counter; the caller then waits for the workers that joined the job to
 * finish. After fork() the child starts with no workers.
 *
 * On a busy machine (another process on the cores) a worker can wait for a core while the caller,
 * done with its tasks, spins for it, and an idle worker's spin takes CPU from the caller's Python
 * between kernels: beside one busy process on 2 cores, serial decode of the coder model kept 31% of
 * its idle rate. So a job whose workers finish long after the caller ran out (STRAGGLE_NS, and
 * longer than the caller's own part) sends the next jobs to the caller alone for ALONE_NS: 66% kept
 * (bench decode --busy). The caller also yields while it waits that long. One straggler is no
 * evidence: on an idle 2-vCPU VM the hypervisor takes a worker's vCPU away for milliseconds about
 * once a second, and going alone on each sent ~18% of a SmolLM2 decode's passes to one core (those
 * passes ~15 ms instead of ~10). So it takes two stragglers within STRAGGLE_WINDOW_NS.
 */
#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#define MAX_WORKERS 63
#ifndef SPIN_NS
#define SPIN_NS 1000000 /* how long an idle worker spins before it sleeps: 1 ms */
#endif
/* A busy machine (another process on the cores the workers need): a job whose workers finish more
 * than STRAGGLE_NS, and more than its own length, after the caller ran out of tasks had a worker
 * waiting for a core. Jobs then run on the caller alone for ALONE_NS (the workers go to sleep and
 * stop taking CPU from the caller and the other process), and then try the workers again. Which
 * thread runs a task never changes a bit, so neither does this. */
#ifndef STRAGGLE_NS
#define STRAGGLE_NS 2000000
#endif
#define STRAGGLE_WINDOW_NS 100000000
#define ALONE_NS 250000000

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void relax(void) { _mm_pause(); }
#elif defined(__aarch64__)
static inline void relax(void) { __asm__ __volatile__("yield"); }
#else
static inline void relax(void) {}
#endif

struct slot {
    pthread_cond_t wake; /* signalled when a job wants this worker */
    int sleeping;        /* under pool.sleep */
};

static struct {
    pthread_mutex_t calls; /* one job at a time */
    pthread_mutex_t sleep;
    int workers; /* started */
    pool_task task;
    void *context;
    int64_t count;
    _Atomic int64_t next;  /* the next task to hand out */
    _Atomic int finished;  /* workers done with the current job */
    _Atomic uint64_t job;  /* generation << 32 | how many take part (the caller and workers 1..that-1) */
    _Atomic int64_t alone_until; /* now_ns() before which jobs run on the caller alone (a busy machine) */
    int64_t straggled;           /* when the last job's workers straggled (under `calls`) */
    struct slot slots[MAX_WORKERS + 1];
} pool = {.calls = PTHREAD_MUTEX_INITIALIZER, .sleep = PTHREAD_MUTEX_INITIALIZER};

struct start {
    int id;
    uint64_t job; /* the job word before the job the worker was started for */
};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void run_tasks(void) {
    for (int64_t i; (i = atomic_fetch_add_explicit(&pool.next, 1, memory_order_relaxed)) < pool.count;)
        pool.task(pool.context, i);
}

/* Whether `job` is newer than `done` and takes worker `id`. */
static inline int wants(uint64_t job, uint64_t done, int id) {
    return (job >> 32) != (done >> 32) && id < (int)(job & 0xffffffffu);
}

/* The next job that takes worker `id` after the job word `done`: spin for SPIN_NS, then sleep
 * until a caller signals this worker. Jobs that do not take it (narrower calls) pass it by: a
 * worker spins only after a job it ran, so idle workers sleep instead of taking cores. */
static uint64_t wait_for_job(int id, uint64_t done) {
    int64_t until = now_ns() + SPIN_NS;
    for (int spins = 0;; spins++) {
        uint64_t job = atomic_load_explicit(&pool.job, memory_order_acquire);
        if (wants(job, done, id)) return job;
        if ((spins & 255) == 255 && now_ns() > until) break;
        relax();
    }
    struct slot *slot = &pool.slots[id];
    pthread_mutex_lock(&pool.sleep);
    slot->sleeping = 1;
    uint64_t job;
    while (!wants(job = atomic_load_explicit(&pool.job, memory_order_acquire), done, id))
        pthread_cond_wait(&slot->wake, &pool.sleep);
    slot->sleeping = 0;
    pthread_mutex_unlock(&pool.sleep);
    return job;
}

/* A worker that takes part in a job is waited for, so the job cannot change under it. */
static void *worker(void *argument) {
    struct start start = *(struct start *)argument;
    free(argument);
    for (uint64_t done = start.job;;) {
        done = wait_for_job(start.id, done);
        run_tasks();
        atomic_fetch_add_explicit(&pool.finished, 1, memory_order_release);
    }
    return NULL;
}

static void start_workers(int wanted, uint64_t job) {
    while (pool.workers < wanted) {
        struct start *start = malloc(sizeof *start);
        if (!start) return;
        *start = (struct start){pool.workers + 1, job};
        pthread_cond_init(&pool.slots[pool.workers + 1].wake, NULL);
        pool.slots[pool.workers + 1].sleeping = 0;
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attributes, worker, start);
        pthread_attr_destroy(&attributes);
        if (failed) {
            free(start);
            return;
        }
        pool.workers++;
    }
}

/* A forked child has none of the workers, and a lock one of them held at the fork would stay held. */
static void forget_workers(void) {
    pthread_mutex_init(&pool.calls, NULL);
    pthread_mutex_init(&pool.sleep, NULL);
    pool.workers = 0;
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_workers); }

void pool_for(int threads, int64_t count, pool_task task, void *context) {
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    if (threads > count) threads = (int)count;
    int64_t began = threads > 1 ? now_ns() : 0;
    if (threads > 1 && began < atomic_load_explicit(&pool.alone_until, memory_order_relaxed)) threads = 1;
    if (threads <= 1) {
        for (int64_t i = 0; i < count; i++) task(context, i);
        return;
    }
    static pthread_once_t registered = PTHREAD_ONCE_INIT;
    pthread_once(&registered, register_fork_handler);
    pthread_mutex_lock(&pool.calls);
    uint64_t before = atomic_load_explicit(&pool.job, memory_order_relaxed);
    start_workers(threads - 1, before);
    int joining = pool.workers + 1 < threads ? pool.workers + 1 : threads;
    pool.task = task;
    pool.context = context;
    pool.count = count;
    atomic_store_explicit(&pool.next, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.finished, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.job, (((before >> 32) + 1) << 32) | (uint64_t)joining, memory_order_release);
    pthread_mutex_lock(&pool.sleep);
    for (int id = 1; id < joining; id++)
        if (pool.slots[id].sleeping) pthread_cond_signal(&pool.slots[id].wake);
    pthread_mutex_unlock(&pool.sleep);
    run_tasks();
    int64_t ran_out = now_ns();
    for (int spins = 0; atomic_load_explicit(&pool.finished, memory_order_acquire) < joining - 1; spins++) {
        if ((spins & 1023) == 1023 && now_ns() - ran_out > STRAGGLE_NS)
            sched_yield(); /* a worker without a core may be queued on this one */
        relax();
    }
    int64_t waited = now_ns() - ran_out;
    if (waited > STRAGGLE_NS && waited > ran_out - began) {
        int64_t now = now_ns();
        if (pool.straggled && now - pool.straggled < STRAGGLE_WINDOW_NS)
            atomic_store_explicit(&pool.alone_until, now + ALONE_NS, memory_order_relaxed);
        pool.straggled = now;
    }
    pthread_mutex_unlock(&pool.calls);
}

int pool_alone(void) { return now_ns() < atomic_load_explicit(&pool.alone_until, memory_order_relaxed); }
