// The skinny kernels' thread pool (#included by skinny.c, one translation unit with it: every kernel hands its
// shares to pool_run).

// The kernels' thread pool, in place of OpenMP's parallel-for. Its wait decides two things libgomp's one spin count
// cannot have at once (docs/peers.md "A busy machine"): between a decode step's C calls the caller runs Python for
// 50-500 us, and a worker that went to sleep there cost a draft_target request ~10% (GOMP_SPINCOUNT=1000 against
// libgomp's default 300000, in process, 4 alternating runs each, Zen 4); but beside another CPU-bound process, long
// spins took the core from the thread holding the work (draft_target 39x slower at the default, 2.0-2.2x at 1000). So a
// waiting thread spins long while the machine has no runnable thread besides ours (/proc/loadavg's running count,
// read at most every POOL_PROBE_NS), and briefly otherwise, then sleeps on a futex. pool_run gives share t of n to
// fn(ctx, t): share 0 on the caller, the others on the workers. Shares never change an output's bits (each output
// element is computed by one fixed sequence, whoever runs it), so a nested call, or a second caller while the pool
// is busy, simply runs every share itself.
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#define POOL_MAX 63
#define POOL_PROBE_NS 20000000LL
typedef void (*pool_fn)(void *ctx, int t);
static struct {
    pthread_mutex_t lock;                // one caller's job at a time
    _Atomic uint32_t gen, done;          // job count (workers sleep on it); jobs finished (the caller sleeps on it)
    _Atomic int left, sleepers, caller_sleeps;
    pool_fn fn;
    void *ctx;
    int n, workers;
    pid_t pid;                           // a forked child starts its own workers
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};
static _Thread_local int pool_inside;    // this thread is running a share: a call from it runs alone
// Spin budgets, ns: long while the machine is otherwise idle, short when something else wants a core (the tests set
// both through ctypes; 0 sleeps at once). pool_busy_seen counts probes that found another runnable thread and
// pool_sleeps the futex waits, for the tests.
long long pool_spin_quiet_ns = 3000000, pool_spin_busy_ns = 20000;
_Atomic long long pool_busy_seen, pool_sleeps;
static _Atomic long long probe_at;
static _Atomic int probe_busy;

static inline long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

// Runnable threads on the machine besides ours: /proc/loadavg's fourth field is running/total; `ours` of them are
// this pool's (the caller and every worker not asleep).
static int others_running(int ours) {
    char buf[128];
    FILE *f = fopen("/proc/loadavg", "r");
    if (!f) return 0;
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    int running = 0;
    if (sscanf(buf, "%*s %*s %*s %d/", &running) != 1) return 0;
    return running > ours ? running - ours : 0;
}

static int pool_cpus = 1 << 30;  // the CPUs this process may run on (pool_grow)

static long long spin_budget(void) {
    const long long t = now_ns();
    if (t - atomic_load_explicit(&probe_at, memory_order_relaxed) > POOL_PROBE_NS) {
        atomic_store_explicit(&probe_at, t, memory_order_relaxed);
        const int busy = others_running(1 + pool.workers - atomic_load(&pool.sleepers)) > 0;
        atomic_store_explicit(&probe_busy, busy, memory_order_relaxed);
        if (busy) atomic_fetch_add_explicit(&pool_busy_seen, 1, memory_order_relaxed);
    }
    // more threads than cores: a spinner always holds a core another of ours needs
    const int busy = atomic_load_explicit(&probe_busy, memory_order_relaxed) || pool.workers + 1 > pool_cpus;
    return busy ? pool_spin_busy_ns : pool_spin_quiet_ns;
}

// Spin until *w != v or the budget is spent; 1 when it changed.
static int spin_until(_Atomic uint32_t *w, uint32_t v, long long budget) {
    if (budget <= 0) return atomic_load(w) != v;
    const long long end = now_ns() + budget;
    for (;;) {
        for (int i = 0; i < 32; i++) {
            if (atomic_load_explicit(w, memory_order_acquire) != v) return 1;
            _mm_pause();
        }
        if (now_ns() > end) return 0;
    }
}

static void futex_wait(_Atomic uint32_t *w, uint32_t v) {
    atomic_fetch_add_explicit(&pool_sleeps, 1, memory_order_relaxed);
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT_PRIVATE, v, NULL, NULL, 0);
}
static void futex_wake(_Atomic uint32_t *w) {
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}

static uint32_t pool_born[POOL_MAX];  // the job count when worker i was started: its first job is the next one

static void *pool_worker(void *arg) {
    const int me = (int)(intptr_t)arg;  // runs share me + 1
    uint32_t seen = pool_born[me];
    pool_inside = 1;
    for (;;) {
        if (!spin_until(&pool.gen, seen, spin_budget())) {
            atomic_fetch_add(&pool.sleepers, 1);
            while (atomic_load(&pool.gen) == seen) futex_wait(&pool.gen, seen);
            atomic_fetch_sub(&pool.sleepers, 1);
        }
        seen = atomic_load_explicit(&pool.gen, memory_order_acquire);
        if (me + 1 < pool.n) pool.fn(pool.ctx, me + 1);
        if (atomic_fetch_sub(&pool.left, 1) == 1) {
            atomic_fetch_add(&pool.done, 1);
            if (atomic_load(&pool.caller_sleeps)) futex_wake(&pool.done);
        }
    }
    return NULL;
}

// Workers for shares 1..n-1 (started on first need, kept for the process); the number running.
static int pool_grow(int n) {
    if (pool.pid != getpid()) {  // first use, or a forked child: the parent's workers are not here
        pool.workers = 0, pool.pid = getpid();
        cpu_set_t set;
        pool_cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : (int)sysconf(_SC_NPROCESSORS_ONLN);
        if (pool_cpus < 1) pool_cpus = 1;
    }
    while (pool.workers < n - 1 && pool.workers < POOL_MAX) {
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        pool_born[pool.workers] = atomic_load(&pool.gen);
        const int rc = pthread_create(&th, &at, pool_worker, (void *)(intptr_t)pool.workers);
        pthread_attr_destroy(&at);
        if (rc) break;
        pool.workers++;
    }
    return pool.workers;
}

static void pool_run(pool_fn fn, void *ctx, int n) {
    if (n > 1 && !pool_inside && pthread_mutex_trylock(&pool.lock) == 0) {
        if (pool_grow(n) >= n - 1) {
            pool.fn = fn, pool.ctx = ctx, pool.n = n;
            atomic_store(&pool.left, pool.workers);
            const uint32_t d = atomic_load(&pool.done);
            atomic_fetch_add_explicit(&pool.gen, 1, memory_order_seq_cst);
            if (atomic_load(&pool.sleepers)) futex_wake(&pool.gen);
            pool_inside = 1;
            fn(ctx, 0);
            pool_inside = 0;
            if (!spin_until(&pool.done, d, spin_budget())) {
                atomic_store(&pool.caller_sleeps, 1);
                while (atomic_load(&pool.done) == d) futex_wait(&pool.done, d);
                atomic_store(&pool.caller_sleeps, 0);
            }
            pthread_mutex_unlock(&pool.lock);
            return;
        }
        pthread_mutex_unlock(&pool.lock);
    }
    for (int t = 0; t < n; t++) fn(ctx, t);
}
