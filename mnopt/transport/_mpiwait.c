/* Waiting for MPI requests without Python's GIL and without a core.
 *
 * MPICH (and Open MPI) spin inside their blocking waits, and a wait
 * written in Python takes the GIL for every poll; beside a training loop
 * whose backward is Python (Chainer) either one costs the compute a core
 * or the GIL.  ``wait_some`` polls with MPI_Testsome from C, the GIL
 * released throughout, napping between polls (nanosleep: the thread
 * leaves the core), and returns as soon as a request has completed.
 *
 * No MPI header is needed: the caller passes the address of the MPI
 * library's MPI_Testsome (in the library mpi4py loaded, found by
 * mnopt/transport/waiting.py), the sizes of a request handle and of an
 * MPI_Status in that library, its MPI_UNDEFINED, and per request the
 * address of the handle inside its mpi4py Request object and of a Status
 * object's MPI_Status.  MPI_Testsome's signature is the same in every
 * MPI; a completed request's handle (MPI_REQUEST_NULL after it) and its
 * status are copied back in place, where mpi4py sees them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <string.h>

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t thread_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void nap(int64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
    nanosleep(&ts, NULL);
}

/* wait_some(testsome, handle_bytes, status_bytes, undefined, requests,
 *           statuses, first_nap_ns, max_nap_ns, max_wait_ns, busy_poll_ns)
 *     -> (error, done, waited_ns, cpu_ns, end_ns)
 *
 * requests, statuses: buffers of n uintptr_t addresses each (of each
 * request's handle, handle_bytes long, and of an MPI_Status, status_bytes
 * long).  The handles are copied into one array and polled with a single
 * MPI_Testsome per pass (one turn of the MPI library's progress engine,
 * not one per request), napping (first_nap_ns, doubling up to
 * max_nap_ns) while none has completed; a poll that took busy_poll_ns
 * (0: never) and twice the wait's fastest poll moved data (a TCP netmod
 * copies from its sockets only inside progress calls), and the next nap
 * is the shortest again, or the kernel's buffers fill while the thread
 * naps long.  Returns after the first pass in
 * which some completed (their handles, now MPI_REQUEST_NULL, and their
 * statuses copied back where they came from), after max_wait_ns (done
 * then empty), or at an error code (error nonzero; done then holds the
 * requests whose statuses say how each ended, as MPI_ERR_IN_STATUS
 * promises).  ``undefined`` is
 * the library's MPI_UNDEFINED (Testsome's count when none is active).
 * done: the indices that completed, in order.  waited_ns, cpu_ns: the
 * wall and this thread's CPU time spent inside, the GIL released;
 * end_ns: CLOCK_MONOTONIC when it stopped waiting (Python's
 * time.monotonic_ns() just after the return, minus end_ns, is how long
 * the thread then waited for the GIL). */
typedef int (*mpi_testsome_fn)(int incount, void *requests, int *outcount,
                               int *indices, void *statuses);

static PyObject *py_wait_some(PyObject *self, PyObject *args)
{
    unsigned long long testsome_address;
    Py_ssize_t hbytes, sbytes;
    int undefined;
    Py_buffer reqs, stats;
    long long first_nap, max_nap, max_wait, busy_poll;
    if (!PyArg_ParseTuple(args, "Knniy*y*LLLL", &testsome_address, &hbytes,
                          &sbytes, &undefined, &reqs, &stats, &first_nap,
                          &max_nap, &max_wait, &busy_poll))
        return NULL;
    Py_ssize_t n = reqs.len / (Py_ssize_t)sizeof(uintptr_t);
    if (stats.len != reqs.len || n == 0 || n > INT32_MAX
            || testsome_address == 0 || hbytes <= 0 || sbytes <= 0) {
        PyBuffer_Release(&reqs);
        PyBuffer_Release(&stats);
        PyErr_SetString(PyExc_ValueError,
                        "wait_some: as many statuses as requests, at least "
                        "one, MPI_Testsome's address and the sizes");
        return NULL;
    }
    char *handles = malloc((size_t)(n * hbytes));
    /* Zeroed: MPI_SUCCESS is 0 in every MPI, and MPICH leaves a status's
     * error field as it was where the request completed well. */
    char *statuses = calloc((size_t)n, (size_t)sbytes);
    int *indices = malloc((size_t)n * sizeof(int));
    if (handles == NULL || statuses == NULL || indices == NULL) {
        free(handles);
        free(statuses);
        free(indices);
        PyBuffer_Release(&reqs);
        PyBuffer_Release(&stats);
        return PyErr_NoMemory();
    }
    const uintptr_t *req = (const uintptr_t *)reqs.buf;
    const uintptr_t *st = (const uintptr_t *)stats.buf;
    mpi_testsome_fn testsome = (mpi_testsome_fn)(uintptr_t)testsome_address;
    int error = 0, count = 0;
    int64_t start, cpu0, waited, cpu, end;

    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        memcpy(handles + i * hbytes, (const void *)req[i], (size_t)hbytes);
    start = now_ns();
    cpu0 = thread_cpu_ns();
    int64_t sleep_ns = first_nap > 0 ? first_nap : 1000;
    int64_t before = start, after, fastest = INT64_MAX;
    for (;;) {
        count = -1;
        error = testsome((int)n, handles, &count, indices, statuses);
        after = now_ns();
        if (error) {
            /* MPI_ERR_IN_STATUS: count and indices are valid, and each
             * status says how its request ended. */
            if (count < 0 || count > n)
                count = 0;
            break;
        }
        if (count == undefined) {   /* none was active */
            count = 0;
            break;
        }
        if (count > 0)
            break;
        if (after - start >= max_wait)
            break;
        int64_t took = after - before;
        if (took < fastest)
            fastest = took;
        if (busy_poll > 0 && took >= busy_poll && took >= 2 * fastest) {
            /* The library moved data in that poll (TCP netmods copy
             * from the sockets only inside progress calls): the next
             * poll comes after the shortest nap, or the kernel's
             * buffers fill while we nap long. */
            sleep_ns = first_nap > 0 ? first_nap : 1000;
        }
        nap(sleep_ns);
        sleep_ns = sleep_ns * 2 < max_nap ? sleep_ns * 2 : max_nap;
        before = now_ns();
    }
    for (int k = 0; k < count; k++) {
        int i = indices[k];
        memcpy((void *)req[i], handles + (Py_ssize_t)i * hbytes,
               (size_t)hbytes);
        memcpy((void *)st[i], statuses + (Py_ssize_t)k * sbytes,
               (size_t)sbytes);
    }
    end = now_ns();
    waited = end - start;
    cpu = thread_cpu_ns() - cpu0;
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&reqs);
    PyBuffer_Release(&stats);
    free(handles);
    free(statuses);
    /* In the order the requests were given (Testsome's may differ). */
    char *done = calloc((size_t)n, 1);
    if (done == NULL) {
        free(indices);
        return PyErr_NoMemory();
    }
    for (int k = 0; k < count; k++)
        done[indices[k]] = 1;
    free(indices);
    PyObject *list = PyList_New(count);
    if (list == NULL) {
        free(done);
        return NULL;
    }
    for (Py_ssize_t i = 0, k = 0; i < n; i++) {
        if (done[i]) {
            PyObject *v = PyLong_FromSsize_t(i);
            if (v == NULL) {
                Py_DECREF(list);
                free(done);
                return NULL;
            }
            PyList_SET_ITEM(list, k++, v);
        }
    }
    free(done);
    return Py_BuildValue("(iNLLL)", error, list, (long long)waited,
                         (long long)cpu, (long long)end);
}

static PyMethodDef methods[] = {
    {"wait_some", py_wait_some, METH_VARARGS,
     "wait_some(testsome, handle_bytes, status_bytes, undefined, requests, "
     "statuses, first_nap_ns, max_nap_ns, max_wait_ns, busy_poll_ns) "
     "-> (error, done, waited_ns, cpu_ns, end_ns)"},
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_mpiwait",
    "Waiting for MPI requests from C, the GIL released, napping between "
    "polls.", -1, methods
};

PyMODINIT_FUNC PyInit__mpiwait(void)
{
    return PyModule_Create(&module);
}
