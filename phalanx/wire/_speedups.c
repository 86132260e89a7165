/* Compiled twins of the hottest steps of phalanx.wire.framing: what the controller pays for
 * each frame it writes to a local rank's pipe, and for each answer it reads from one.
 * Optional: where this module did not build (no compiler, another interpreter), the
 * pure-Python steps run instead, and do the same.
 *
 * FrameSender(conn, lock, fd) is Connection.send for a pipe's write end: a frame of one bytes
 * object no longer than PIPE_BUF, written under the connection's lock while it has no backlog
 * and is neither broken nor closed (such a write to a non-blocking pipe is whole or none).
 * Anything else (a frame of several segments or a larger one, a backlog, a broken or closed
 * connection, a pipe that is full, an error) goes to the connection's own send.
 *
 * PairReader(reader, stream) is FrameReader.recv_pair for a PipeStream: one non-blocking
 * read of the whole chunk under the stream's closing lock, and the one frame of a header and
 * a pickle it held returned as that pair, a tuple of two bytes objects. Anything else (bytes
 * carried from an earlier read, a large frame arriving, a broken stream, a read of several
 * frames or of part of one, the end of the stream, an error other than EAGAIN or EINTR) is
 * left to the reader's own Python, which reads or parses it as ever.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

/* <u32 nseg><u64 body> <u64 len_0><u64 len_1>: a two-segment frame's prefix and table */
#define PREFIX_SIZE 12
#define PAIR_START 28

static PyObject *str_broken, *str_big, *str_buf, *str_pair_cap, *str_read_fd, *str_chunk,
    *str_acquire, *str_release, *str_recv_once, *str_parse, *str_conn_broken, *str_closed, *str_backlog,
    *str_send, *str_keep_rest, *str_writer, *str_schedule;

static uint64_t
le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) {
        v = (v << 8) | p[i];
    }
    return v;
}

static uint32_t
le32(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16)
           | ((uint32_t)p[3] << 24);
}

/* -- what both types do ------------------------------------------------------------------ */

/* Whether obj.name is None (want_none) or, else, empty (false: b"", a deque of nothing,
 * False): 1 yes, 0 no, -1 on error. */
static int
attr_is_none_or_empty(PyObject *obj, PyObject *name, int want_none)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) {
        return -1;
    }
    int truth = want_none ? (v != Py_None) : PyObject_IsTrue(v);
    Py_DECREF(v);
    return truth < 0 ? -1 : !truth;
}

static int
lock_take(PyObject *lock)
{
    PyObject *got = PyObject_CallMethodNoArgs(lock, str_acquire);
    Py_XDECREF(got);
    return got == NULL ? -1 : 0;
}

/* Release ``lock``, keeping an error raised while it was held: -1 when there is one (that
 * error, or the release's own), 0 otherwise. */
static int
lock_give_back(PyObject *lock)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *released = PyObject_CallMethodNoArgs(lock, str_release);
    if (released == NULL) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return -1;
    }
    Py_DECREF(released);
    if (type != NULL) {
        PyErr_Restore(type, value, traceback);
        return -1;
    }
    return 0;
}

/* -- PairReader ---------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *reader;  /* the FrameReader: its state, and its Python for anything unusual */
    PyObject *stream;  /* its PipeStream: read_fd, read under the closing lock */
    PyObject *lock;    /* the stream's closing lock */
    PyObject *chunk;   /* the reader's read buffer (a bytearray, never resized) */
} PairReader;

static int
PairReader_traverse(PairReader *self, visitproc visit, void *arg)
{
    Py_VISIT(self->reader);
    Py_VISIT(self->stream);
    Py_VISIT(self->lock);
    Py_VISIT(self->chunk);
    return 0;
}

static int
PairReader_clear(PairReader *self)
{
    Py_CLEAR(self->reader);
    Py_CLEAR(self->stream);
    Py_CLEAR(self->lock);
    Py_CLEAR(self->chunk);
    return 0;
}

static void
PairReader_dealloc(PairReader *self)
{
    PyObject_GC_UnTrack(self);
    PairReader_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
PairReader_init(PairReader *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"reader", "stream", "lock", NULL};
    PyObject *reader, *stream, *lock, *chunk;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO", kwlist, &reader, &stream, &lock)) {
        return -1;
    }
    chunk = PyObject_GetAttr(reader, str_chunk);
    if (chunk == NULL) {
        return -1;
    }
    if (!PyByteArray_CheckExact(chunk) || PyByteArray_GET_SIZE(chunk) <= PAIR_START) {
        Py_DECREF(chunk);
        PyErr_SetString(PyExc_TypeError, "the reader's _chunk must be a bytearray");
        return -1;
    }
    Py_INCREF(reader);
    Py_INCREF(stream);
    Py_INCREF(lock);
    Py_XSETREF(self->reader, reader);
    Py_XSETREF(self->stream, stream);
    Py_XSETREF(self->lock, lock);
    Py_XSETREF(self->chunk, chunk);
    return 0;
}

/* Whether the reader holds nothing of an earlier read (no carried bytes, no large frame, not
 * broken): then a read starts at a frame's first byte. -1 on error. */
static int
reader_is_clean(PyObject *reader)
{
    int clean = attr_is_none_or_empty(reader, str_broken, 1);
    if (clean == 1) {
        clean = attr_is_none_or_empty(reader, str_big, 1);
    }
    if (clean == 1) {
        clean = attr_is_none_or_empty(reader, str_buf, 0);
    }
    return clean;
}

static PyObject *
PairReader_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                      PyObject *kwnames)
{
    PairReader *self = (PairReader *)callable;
    (void)args;
    if (PyVectorcall_NARGS(nargsf) != 0 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "PairReader() takes no arguments");
        return NULL;
    }
    int clean = reader_is_clean(self->reader);
    if (clean < 0) {
        return NULL;
    }
    if (!clean) {
        return PyObject_CallMethodNoArgs(self->reader, str_recv_once);
    }
    if (lock_take(self->lock) < 0) {
        return NULL;
    }
    /* the descriptor is read under the lock: a stream closed meanwhile has -1 there */
    ssize_t n = -1;
    int err = 0;
    char *buf = PyByteArray_AS_STRING(self->chunk);
    PyObject *fd_obj = PyObject_GetAttr(self->stream, str_read_fd);
    if (fd_obj != NULL) {
        long fd = PyLong_AsLong(fd_obj);
        Py_DECREF(fd_obj);
        if (!(fd == -1 && PyErr_Occurred())) {
            n = read((int)fd, buf, (size_t)PyByteArray_GET_SIZE(self->chunk));
            err = errno;
        }
    }
    if (lock_give_back(self->lock) < 0) {
        return NULL;
    }
    if (n < 0) {
        if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR) {
            return PyList_New(0);  /* nothing there yet: no frames */
        }
        /* any other error the Python read raises as the reader does (ConnectionLost) */
        return PyObject_CallMethodNoArgs(self->reader, str_recv_once);
    }
    if (n == 0) {  /* the end of the stream: the Python read sees it too, and raises it */
        return PyObject_CallMethodNoArgs(self->reader, str_recv_once);
    }
    if (n > PAIR_START) {
        const unsigned char *p = (const unsigned char *)buf;
        uint32_t nseg = le32(p);
        uint64_t body = le64(p + 4), first = le64(p + 12), second = le64(p + 20);
        if (nseg == 2 && (uint64_t)n == PREFIX_SIZE + body) {  /* body >= 17: n > 28 */
            PyObject *cap_obj = PyObject_GetAttr(self->reader, str_pair_cap);
            if (cap_obj == NULL) {
                return NULL;
            }
            long long cap = PyLong_AsLongLong(cap_obj);
            Py_DECREF(cap_obj);
            if (cap == -1 && PyErr_Occurred()) {
                return NULL;
            }
            if (first <= body - 16 && second == body - 16 - first && cap >= 0
                && body <= (uint64_t)cap) {
                PyObject *head = PyBytes_FromStringAndSize(buf + PAIR_START, (Py_ssize_t)first);
                if (head == NULL) {
                    return NULL;
                }
                PyObject *payload = PyBytes_FromStringAndSize(
                    buf + PAIR_START + first, (Py_ssize_t)(n - PAIR_START - (ssize_t)first));
                if (payload == NULL) {
                    Py_DECREF(head);
                    return NULL;
                }
                PyObject *pair = PyTuple_New(2);
                if (pair == NULL) {
                    Py_DECREF(head);
                    Py_DECREF(payload);
                    return NULL;
                }
                PyTuple_SET_ITEM(pair, 0, head);
                PyTuple_SET_ITEM(pair, 1, payload);
                return pair;
            }
        }
    }
    /* several frames, part of one, or one to be refused: the reader parses what was read */
    PyObject *count = PyLong_FromSsize_t((Py_ssize_t)n);
    if (count == NULL) {
        return NULL;
    }
    PyObject *frames = PyObject_CallMethodObjArgs(self->reader, str_parse, self->chunk, count,
                                                  Py_False, NULL);
    Py_DECREF(count);
    return frames;
}

static PyObject *
PairReader_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PairReader *self = (PairReader *)PyType_GenericNew(type, args, kwds);
    if (self != NULL) {
        self->vectorcall = PairReader_vectorcall;
    }
    return (PyObject *)self;
}

static PyObject *
PairReader_call(PyObject *self, PyObject *args, PyObject *kwds)
{
    return PyVectorcall_Call(self, args, kwds);
}

static PyTypeObject PairReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phalanx.wire._speedups.PairReader",
    .tp_doc = PyDoc_STR("PairReader(reader, stream, lock): FrameReader.recv_pair of a pipe, "
                        "compiled; called with no arguments."),
    .tp_basicsize = sizeof(PairReader),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(PairReader, vectorcall),
    .tp_new = PairReader_new,
    .tp_init = (initproc)PairReader_init,
    .tp_dealloc = (destructor)PairReader_dealloc,
    .tp_traverse = (traverseproc)PairReader_traverse,
    .tp_clear = (inquiry)PairReader_clear,
    .tp_call = PairReader_call,
};


/* -- FrameSender --------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *conn;  /* the Connection: its state, its backlog, and its Python send */
    PyObject *lock;  /* its lock */
    int fd;          /* its stream's write end (closed only by close(), under the lock) */
} FrameSender;

static int
FrameSender_traverse(FrameSender *self, visitproc visit, void *arg)
{
    Py_VISIT(self->conn);
    Py_VISIT(self->lock);
    return 0;
}

static int
FrameSender_clear(FrameSender *self)
{
    Py_CLEAR(self->conn);
    Py_CLEAR(self->lock);
    return 0;
}

static void
FrameSender_dealloc(FrameSender *self)
{
    PyObject_GC_UnTrack(self);
    FrameSender_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
FrameSender_init(FrameSender *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"conn", "lock", "fd", NULL};
    PyObject *conn, *lock;
    int fd;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOi", kwlist, &conn, &lock, &fd)) {
        return -1;
    }
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "FrameSender needs a descriptor");
        return -1;
    }
    Py_INCREF(conn);
    Py_INCREF(lock);
    Py_XSETREF(self->conn, conn);
    Py_XSETREF(self->lock, lock);
    self->fd = fd;
    return 0;
}

/* Whether the connection takes a write now: not broken, not closed, no backlog. -1 on
 * error. */
static int
conn_is_clear(PyObject *conn)
{
    int clear = attr_is_none_or_empty(conn, str_conn_broken, 1);
    if (clear == 1) {
        clear = attr_is_none_or_empty(conn, str_closed, 0);
    }
    if (clear == 1) {
        clear = attr_is_none_or_empty(conn, str_backlog, 0);
    }
    return clear;
}

static PyObject *FrameSender_vectorcall(PyObject *, PyObject *const *, size_t, PyObject *);

static PyObject *
FrameSender_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    FrameSender *self = (FrameSender *)PyType_GenericNew(type, args, kwds);
    if (self != NULL) {
        self->vectorcall = FrameSender_vectorcall;
    }
    return (PyObject *)self;
}

static PyObject *
FrameSender_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                       PyObject *kwnames)
{
    FrameSender *self = (FrameSender *)callable;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "FrameSender() takes one frame");
        return NULL;
    }
    PyObject *segments = args[0];
    PyObject *data = NULL;
    if (PyList_CheckExact(segments) && PyList_GET_SIZE(segments) == 1) {
        data = PyList_GET_ITEM(segments, 0);
        if (!PyBytes_CheckExact(data) || PyBytes_GET_SIZE(data) > PIPE_BUF
            || PyBytes_GET_SIZE(data) == 0) {
            data = NULL;
        }
    }
    if (data == NULL) {
        return PyObject_CallMethodOneArg(self->conn, str_send, segments);
    }
    if (lock_take(self->lock) < 0) {
        return NULL;
    }
    Py_ssize_t size = PyBytes_GET_SIZE(data);
    ssize_t written = -1;
    int clear = conn_is_clear(self->conn);
    if (clear > 0) {
        written = write(self->fd, PyBytes_AS_STRING(data), (size_t)size);
        if (written > 0 && written < size) {  /* no pipe does this (PIPE_BUF); kept whole */
            PyObject *sent = PyLong_FromSsize_t(written);
            PyObject *kept = sent == NULL ? NULL : PyObject_CallMethodObjArgs(
                self->conn, str_keep_rest, segments, sent, NULL);
            Py_XDECREF(sent);
            if (kept == NULL) {
                clear = -1;
            }
            Py_XDECREF(kept);
        }
    }
    if (lock_give_back(self->lock) < 0 || clear < 0) {
        return NULL;
    }
    if (written == size) {
        Py_RETURN_NONE;
    }
    if (written > 0) {  /* the rest is queued: the connection's writer takes it on */
        PyObject *writer = PyObject_GetAttr(self->conn, str_writer);
        if (writer == NULL) {
            return NULL;
        }
        PyObject *done = PyObject_CallMethodOneArg(writer, str_schedule, self->conn);
        Py_DECREF(writer);
        return done;
    }
    /* not clear, the pipe full, or an error: the connection's send decides, as ever */
    return PyObject_CallMethodOneArg(self->conn, str_send, segments);
}

static PyObject *
FrameSender_call(PyObject *self, PyObject *args, PyObject *kwds)
{
    return PyVectorcall_Call(self, args, kwds);
}

static PyTypeObject FrameSenderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phalanx.wire._speedups.FrameSender",
    .tp_doc = PyDoc_STR("FrameSender(conn, lock, fd): Connection.send to a pipe, compiled; "
                        "called with one frame."),
    .tp_basicsize = sizeof(FrameSender),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(FrameSender, vectorcall),
    .tp_new = FrameSender_new,
    .tp_init = (initproc)FrameSender_init,
    .tp_dealloc = (destructor)FrameSender_dealloc,
    .tp_traverse = (traverseproc)FrameSender_traverse,
    .tp_clear = (inquiry)FrameSender_clear,
    .tp_call = FrameSender_call,
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "phalanx.wire._speedups",
    .m_doc = PyDoc_STR("Compiled twins of phalanx.wire.framing's hottest steps."),
    .m_size = -1,
};

#define INTERN(var, text)                              \
    do {                                               \
        if ((var = PyUnicode_InternFromString(text)) == NULL) { \
            return NULL;                               \
        }                                              \
    } while (0)

PyMODINIT_FUNC
PyInit__speedups(void)
{
    INTERN(str_broken, "_broken");
    INTERN(str_big, "_big");
    INTERN(str_buf, "_buf");
    INTERN(str_pair_cap, "_pair_cap");
    INTERN(str_read_fd, "read_fd");
    INTERN(str_chunk, "_chunk");
    INTERN(str_acquire, "acquire");
    INTERN(str_release, "release");
    INTERN(str_recv_once, "recv_once");
    INTERN(str_parse, "_parse");
    INTERN(str_conn_broken, "broken");
    INTERN(str_closed, "closed");
    INTERN(str_backlog, "_backlog");
    INTERN(str_send, "send");
    INTERN(str_keep_rest, "_keep_rest");
    INTERN(str_writer, "_writer");
    INTERN(str_schedule, "schedule");
    if (PyType_Ready(&PairReaderType) < 0 || PyType_Ready(&FrameSenderType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&speedups_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&PairReaderType);
    if (PyModule_AddObject(module, "PairReader", (PyObject *)&PairReaderType) < 0) {
        Py_DECREF(&PairReaderType);
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&FrameSenderType);
    if (PyModule_AddObject(module, "FrameSender", (PyObject *)&FrameSenderType) < 0) {
        Py_DECREF(&FrameSenderType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
