/* Ending a rank that would otherwise wait for ever at MPI's start.
 *
 * MPI's start (MPI_Init, run by ``from mpi4py import MPI``) waits until
 * every rank of the job has started it, and holds Python's GIL meanwhile:
 * no Python thread, signal handler or alarm handler runs until it
 * returns.  When a rank exited or failed before starting MPI, the others
 * wait there for ever.  Two watches, in C because Python cannot run:
 *
 * - ``arm``/``disarm``: a thread that, while the caller is in MPI's start,
 *   writes a warning on stderr after ``warning_s`` and, after
 *   ``timeout_s``, a last message and ends the process by SIGALRM (a
 *   signal death, which mpiexec takes as the end of the job; a plain
 *   non-zero exit does not end MPICH's).  With ``interrupt`` text, Ctrl-C
 *   (SIGINT) meanwhile writes it and ends the process by SIGINT, rather
 *   than waiting for MPI's start to return before Python sees it.
 * - ``watch_exit``: this process exiting with a non-zero status (any way:
 *   sys.exit, raise SystemExit, argparse's errors) writes a message and
 *   ends it by SIGALRM, so the launcher ends the job at once; checked in
 *   an on_exit handler, which sees the real status after Python has shut
 *   down.  ``unwatch_exit`` once MPI has started (its own failure
 *   reports take over then).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TEXT_BYTES 4096

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake;
/* Which arming the thread serves: disarm and a new arm change it. */
static unsigned long generation = 0;
static char warning_text[TEXT_BYTES], timeout_text[TEXT_BYTES];
static char interrupt_text[TEXT_BYTES];
static size_t interrupt_len = 0;
static struct sigaction saved_interrupt;
static int interrupt_installed = 0;

static pid_t exit_pid = 0;
static int exit_watching = 0, exit_registered = 0;
static char exit_before[TEXT_BYTES], exit_after[TEXT_BYTES];

static void write_all(const char *text, size_t n)
{
    while (n > 0) {
        ssize_t done = write(2, text, n);
        if (done <= 0)
            return;
        text += done;
        n -= (size_t)done;
    }
}

static void die_by(int sig)
{
    sigset_t set;
    signal(sig, SIG_DFL);
    sigemptyset(&set);
    sigaddset(&set, sig);
    pthread_sigmask(SIG_UNBLOCK, &set, NULL);
    kill(getpid(), sig);
    /* Delivered before kill returns where it is not blocked elsewhere. */
    pause();
}

static void deadline_after(struct timespec *at, double seconds)
{
    clock_gettime(CLOCK_MONOTONIC, at);
    at->tv_sec += (time_t)seconds;
    at->tv_nsec += (long)((seconds - (double)(time_t)seconds) * 1e9);
    if (at->tv_nsec >= 1000000000L) {
        at->tv_sec += 1;
        at->tv_nsec -= 1000000000L;
    }
}

/* Wait until ``at`` or a disarm; returns whether still armed. */
static int still_armed_at(unsigned long mine, const struct timespec *at)
{
    int armed = 1;
    pthread_mutex_lock(&lock);
    while (generation == mine) {
        if (pthread_cond_timedwait(&wake, &lock, at) != 0)
            break;   /* ETIMEDOUT (or an error: treated alike) */
    }
    armed = generation == mine;
    pthread_mutex_unlock(&lock);
    return armed;
}

typedef struct {
    unsigned long generation;
    double warning_s, timeout_s;
} watch_t;

static void *watch(void *arg)
{
    watch_t w = *(watch_t *)arg;
    struct timespec at;
    free(arg);
    if (w.warning_s > 0 && (w.timeout_s <= 0 || w.warning_s < w.timeout_s)) {
        deadline_after(&at, w.warning_s);
        if (!still_armed_at(w.generation, &at))
            return NULL;
        write_all(warning_text, strlen(warning_text));
    }
    if (w.timeout_s <= 0) {
        /* No timeout: only the disarm ends this thread. */
        pthread_mutex_lock(&lock);
        while (generation == w.generation)
            pthread_cond_wait(&wake, &lock);
        pthread_mutex_unlock(&lock);
        return NULL;
    }
    deadline_after(&at, w.timeout_s - (w.warning_s > 0 &&
                                        w.warning_s < w.timeout_s
                                        ? w.warning_s : 0));
    if (!still_armed_at(w.generation, &at))
        return NULL;
    write_all(timeout_text, strlen(timeout_text));
    die_by(SIGALRM);
    return NULL;
}

static void on_interrupt(int sig)
{
    write_all(interrupt_text, interrupt_len);
    die_by(sig);
}

static void copy_text(char *to, const char *from)
{
    strncpy(to, from, TEXT_BYTES - 1);
    to[TEXT_BYTES - 1] = '\0';
}

/* arm(warning_s, timeout_s, warning_text, timeout_text, interrupt_text)
 * warning_s, timeout_s: 0 for none; interrupt_text: None to leave SIGINT
 * to Python. */
static PyObject *py_arm(PyObject *self, PyObject *args)
{
    double warning_s, timeout_s;
    const char *warning, *timeout, *interrupt;
    pthread_t thread;
    pthread_attr_t attr;
    watch_t *w;
    if (!PyArg_ParseTuple(args, "ddssz", &warning_s, &timeout_s, &warning,
                          &timeout, &interrupt))
        return NULL;
    w = malloc(sizeof *w);
    if (w == NULL)
        return PyErr_NoMemory();
    pthread_mutex_lock(&lock);
    generation++;
    pthread_cond_broadcast(&wake);
    copy_text(warning_text, warning);
    copy_text(timeout_text, timeout);
    w->generation = generation;
    pthread_mutex_unlock(&lock);
    w->warning_s = warning_s;
    w->timeout_s = timeout_s;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&thread, &attr, watch, w) != 0) {
        pthread_attr_destroy(&attr);
        free(w);
        PyErr_SetString(PyExc_RuntimeError, "cannot start the watch thread");
        return NULL;
    }
    pthread_attr_destroy(&attr);
    if (interrupt != NULL && !interrupt_installed) {
        struct sigaction sa;
        copy_text(interrupt_text, interrupt);
        interrupt_len = strlen(interrupt_text);
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_interrupt;
        sigemptyset(&sa.sa_mask);
        if (sigaction(SIGINT, &sa, &saved_interrupt) == 0)
            interrupt_installed = 1;
    }
    Py_RETURN_NONE;
}

static PyObject *py_disarm(PyObject *self, PyObject *noargs)
{
    pthread_mutex_lock(&lock);
    generation++;
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&lock);
    if (interrupt_installed) {
        sigaction(SIGINT, &saved_interrupt, NULL);
        interrupt_installed = 0;
    }
    Py_RETURN_NONE;
}

static void on_exit_status(int status, void *arg)
{
    char text[2 * TEXT_BYTES + 32];
    int n;
    if (!exit_watching || status == 0 || getpid() != exit_pid)
        return;
    n = snprintf(text, sizeof text, "%s%d%s", exit_before, status,
                 exit_after);
    if (n > 0)
        write_all(text, (size_t)n < sizeof text ? (size_t)n
                                                : sizeof text - 1);
    die_by(SIGALRM);
}

/* watch_exit(before, after): on a non-zero exit of this process (not of
 * a fork of it), write before + status + after and end by SIGALRM. */
static PyObject *py_watch_exit(PyObject *self, PyObject *args)
{
    const char *before, *after;
    if (!PyArg_ParseTuple(args, "ss", &before, &after))
        return NULL;
    copy_text(exit_before, before);
    copy_text(exit_after, after);
    exit_pid = getpid();
    if (!exit_registered) {
        if (on_exit(on_exit_status, NULL) != 0) {
            PyErr_SetString(PyExc_RuntimeError, "on_exit failed");
            return NULL;
        }
        exit_registered = 1;
    }
    exit_watching = 1;
    Py_RETURN_NONE;
}

static PyObject *py_unwatch_exit(PyObject *self, PyObject *noargs)
{
    exit_watching = 0;
    Py_RETURN_NONE;
}

static PyObject *py_exit_watched(PyObject *self, PyObject *noargs)
{
    return PyBool_FromLong(exit_watching && getpid() == exit_pid);
}

static PyMethodDef methods[] = {
    {"arm", py_arm, METH_VARARGS,
     "arm(warning_s, timeout_s, warning_text, timeout_text, interrupt_text)"
     ": watch a wait in MPI's start (see the module's source)."},
    {"disarm", py_disarm, METH_NOARGS, "End the watch ``arm`` started."},
    {"watch_exit", py_watch_exit, METH_VARARGS,
     "watch_exit(before, after): end this process by SIGALRM, saying "
     "before + status + after, where it exits with a non-zero status."},
    {"unwatch_exit", py_unwatch_exit, METH_NOARGS, "Undo watch_exit."},
    {"exit_watched", py_exit_watched, METH_NOARGS,
     "Whether watch_exit watches this process."},
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_startwatch",
    "Ending a rank that would wait for ever at MPI's start "
    "(mnopt/stall/_startwatch.c).", -1, methods
};

PyMODINIT_FUNC PyInit__startwatch(void)
{
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&wake, &attr);
    pthread_condattr_destroy(&attr);
    return PyModule_Create(&module);
}
