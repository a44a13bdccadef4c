/* The C kernels' own worker threads: a split of gemm.c's and conv.c's work, entirely in C.
 *
 * Why not kernels/_threads.py's Python helpers: handing a part to a thread that sleeps,
 * and taking the GIL back on the way, costs 40-130 us on a 2-vCPU VM (a split of 80 us
 * of work took 155 us). These workers spin for a bounded time after each part
 * (OpenBLAS's do the same, far longer), and neither side needs the GIL: ctypes
 * releases it for the whole call. One split runs at a time; a caller that finds the
 * pool busy (a concurrent run's split) does all its parts itself. */
#include "kernels.h"

#include <pthread.h>
#include <sched.h>
#include <time.h>

#define MAX_WORKERS 63

static struct {
    pthread_mutex_t lock; /* the sleepers' wake-up, the caller's sleep, starting workers */
    pthread_cond_t wake;  /* workers that spun out */
    pthread_cond_t idle;  /* the caller, once it spun out */
    pthread_mutex_t busy; /* held for one split */
    int workers;
    long spin_ns;
    task_fn fn;
    void *args;
    int parts;
    int bounds[MAX_WORKERS + 2];
    int gen;       /* atomic: the split's generation */
    int remaining; /* atomic: workers yet to finish this generation */
    int sleepers;  /* under lock */
    int caller_sleeping; /* under lock */
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
       PTHREAD_MUTEX_INITIALIZER};

static long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* spin while *word == value for at most ns: the word's value then. It yields every few
 * microseconds, so that a thread waiting for this core (a Python helper's part of
 * numpy's work) runs at once rather than sharing it with the spin. */
static int spin_while_equal(const int *word, int value, long ns)
{
    long end = now_ns() + ns;
    for (;;) {
        for (int i = 0; i < 32; i++) {
            int v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
            if (v != value)
                return v;
            cpu_relax();
        }
        if (now_ns() >= end)
            return __atomic_load_n(word, __ATOMIC_ACQUIRE);
        sched_yield();
    }
}

static void *worker(void *arg)
{
    int id = (int)(long)arg; /* the part this worker takes: 1 .. workers */
    int seen = 0;
    for (;;) {
        int g = spin_while_equal(&P.gen, seen, P.spin_ns);
        if (g == seen) {
            pthread_mutex_lock(&P.lock);
            P.sleepers++;
            while ((g = __atomic_load_n(&P.gen, __ATOMIC_ACQUIRE)) == seen)
                pthread_cond_wait(&P.wake, &P.lock);
            P.sleepers--;
            pthread_mutex_unlock(&P.lock);
        }
        seen = g;
        if (id < P.parts)
            P.fn(P.args, P.bounds[id], P.bounds[id + 1]);
        if (__atomic_sub_fetch(&P.remaining, 1, __ATOMIC_ACQ_REL) == 0) {
            pthread_mutex_lock(&P.lock);
            if (P.caller_sleeping)
                pthread_cond_signal(&P.idle);
            pthread_mutex_unlock(&P.lock);
        }
    }
    return 0;
}

static void after_fork_in_child(void)
{
    /* the parent's workers do not exist here: start again with none */
    pthread_mutex_init(&P.lock, 0);
    pthread_cond_init(&P.wake, 0);
    pthread_cond_init(&P.idle, 0);
    pthread_mutex_init(&P.busy, 0);
    P.workers = P.sleepers = P.caller_sleeping = 0;
    P.gen = P.remaining = 0;
}

/* Start workers up to n (at most MAX_WORKERS), spinning spin_ns after each part: the
 * number running. */
int he_pool_start(int n, long spin_ns)
{
    static int registered = 0;
    if (n > MAX_WORKERS)
        n = MAX_WORKERS;
    pthread_mutex_lock(&P.busy); /* no split in flight while workers join */
    pthread_mutex_lock(&P.lock);
    if (!registered) {
        pthread_atfork(0, 0, after_fork_in_child);
        registered = 1;
    }
    P.spin_ns = spin_ns;
    while (P.workers < n) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        /* the new worker's first generation must be the current one */
        if (pthread_create(&t, &attr, worker, (void *)(long)(P.workers + 1)) != 0) {
            pthread_attr_destroy(&attr);
            break;
        }
        pthread_attr_destroy(&attr);
        P.workers++;
    }
    int running = P.workers;
    pthread_mutex_unlock(&P.lock);
    pthread_mutex_unlock(&P.busy);
    return running;
}

/* 1 while every worker still spins after its last part (a split now costs no wake-up),
 * else 0. Read without the lock: a hint for splitting small work, not a promise. */
int he_pool_hot(void)
{
    return P.workers > 0 && __atomic_load_n(&P.sleepers, __ATOMIC_RELAXED) == 0;
}

/* fn(args, i0, i1) over [0, n) in `parts` parts: the first here, the others on the
 * workers; returns when all are done. */
void he_parallel(task_fn fn, void *args, int n, int parts)
{
    if (parts > P.workers + 1)
        parts = P.workers + 1;
    if (parts > n)
        parts = n;
    if (parts < 2 || pthread_mutex_trylock(&P.busy) != 0) {
        fn(args, 0, n);
        return;
    }
    P.fn = fn;
    P.args = args;
    P.parts = parts;
    for (int i = 0; i <= parts; i++)
        P.bounds[i] = (int)((long)n * i / parts);
    __atomic_store_n(&P.remaining, P.workers, __ATOMIC_RELAXED);
    __atomic_add_fetch(&P.gen, 1, __ATOMIC_RELEASE);
    pthread_mutex_lock(&P.lock);
    if (P.sleepers)
        pthread_cond_broadcast(&P.wake);
    pthread_mutex_unlock(&P.lock);
    fn(args, P.bounds[0], P.bounds[1]);
    long end = now_ns() + P.spin_ns; /* the workers' parts end about when this one does */
    while (__atomic_load_n(&P.remaining, __ATOMIC_ACQUIRE) != 0 && now_ns() < end)
        for (int i = 0; i < 32; i++)
            cpu_relax();
    if (__atomic_load_n(&P.remaining, __ATOMIC_ACQUIRE) != 0) {
        pthread_mutex_lock(&P.lock);
        P.caller_sleeping = 1;
        while (__atomic_load_n(&P.remaining, __ATOMIC_ACQUIRE) != 0)
            pthread_cond_wait(&P.idle, &P.lock);
        P.caller_sleeping = 0;
        pthread_mutex_unlock(&P.lock);
    }
    pthread_mutex_unlock(&P.busy);
}
