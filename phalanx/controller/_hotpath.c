/* Compiled twins of the controller's two steps a plain call pays once per rank: its frame
 * made and sent, and its answer routed. Optional: where this module did not build, or where
 * PHALANX_PURE_PYTHON=1, the Python steps run instead, and do the same
 * (phalanx.controller.compiled decides).
 *
 * send_small(entries, ranks, call_id, future, prefix, tail, fail_if_dead) is Sender._deliver
 * of protocol.small_call_frames: for each rank, in order, the frame
 * prefix + <BQI header (CALL, call_id, rank) + tail, the call registered on the rank's entry
 * (entry.calls[call_id] = future), the frame handed to entry.send, and
 * fail_if_dead(entry, call_id, future) where the entry is no longer alive.
 *
 * AnswerRouter(read, by_rank, channel) is read(), with the dispatcher's pump's routing of a
 * lone answer done here: where read() returns one frame of a header and a pickle that is a
 * RESULT from a rank routed to ``channel``, the rank is heard from now, its call is taken
 * from its entry (or its cohort's) and resolved with the pickle, and the router returns []
 * (nothing left to read). Anything else read() returns, it returns as it came, untouched, for
 * the pump's Python; errors go up as they came.
 *
 * route_events(events, by_fd) is the pump's loop over a poll's events, for the events of
 * descriptors watched with an AnswerRouter: each such router is called, and an event whose
 * read it routed whole (or that had nothing to read) is done. It returns the events left, in
 * their order, for the pump's Python loop, and whether any watched descriptor was read. A
 * router whose read was something else holds it (``holds``), and hands it over, value or
 * error, at its next call: the pump's, for that event, as if it read it then.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* phalanx.wire.protocol's header: <BQI, the kind, the call id, the rank */
#define HEAD_SIZE 13
#define KIND_CALL 1
#define KIND_RESULT 2

static PyObject *str_calls, *str_send, *str_alive, *str_channel, *str_heard_at, *str_cohorts,
    *str_cohort_call, *str_resolve_rank;

static void
put_le(unsigned char *p, uint64_t v, int size)
{
    for (int i = 0; i < size; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

static uint64_t
get_le(const unsigned char *p, int size)
{
    uint64_t v = 0;
    for (int i = size - 1; i >= 0; i--) {
        v = (v << 8) | p[i];
    }
    return v;
}

/* -- send_small ------------------------------------------------------------------------- */

/* One rank's part: 0, or -1 with an error set. */
static int
send_one(PyObject *entries, PyObject *rank_obj, PyObject *call_id, uint64_t id,
         PyObject *future, PyObject *prefix, PyObject *tail, PyObject *fail_if_dead)
{
    PyObject *index = PyNumber_Index(rank_obj);  /* (any integer, as struct's pack) */
    if (index == NULL) {
        return -1;
    }
    unsigned long long rank = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    if (rank == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    if (rank > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "a rank number over 32 bits");
        return -1;
    }
    Py_ssize_t psize = PyBytes_GET_SIZE(prefix), tsize = PyBytes_GET_SIZE(tail);
    PyObject *data = PyBytes_FromStringAndSize(NULL, psize + HEAD_SIZE + tsize);
    if (data == NULL) {
        return -1;
    }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(data);
    memcpy(p, PyBytes_AS_STRING(prefix), (size_t)psize);
    p[psize] = KIND_CALL;
    put_le(p + psize + 1, id, 8);
    put_le(p + psize + 9, rank, 4);
    memcpy(p + psize + HEAD_SIZE, PyBytes_AS_STRING(tail), (size_t)tsize);
    PyObject *frame = PyList_New(1);
    if (frame == NULL) {
        Py_DECREF(data);
        return -1;
    }
    PyList_SET_ITEM(frame, 0, data);

    int status = -1;
    PyObject *calls = NULL, *send = NULL, *sent = NULL, *alive = NULL;
    PyObject *entry = PyObject_GetItem(entries, rank_obj);
    if (entry == NULL) {
        goto done;
    }
    calls = PyObject_GetAttr(entry, str_calls);
    if (calls == NULL || PyObject_SetItem(calls, call_id, future) < 0) {
        goto done;
    }
    send = PyObject_GetAttr(entry, str_send);
    if (send == NULL || (sent = PyObject_CallOneArg(send, frame)) == NULL) {
        goto done;
    }
    alive = PyObject_GetAttr(entry, str_alive);
    int truth = alive == NULL ? -1 : PyObject_IsTrue(alive);
    if (truth < 0) {
        goto done;
    }
    if (!truth) {
        PyObject *failed = PyObject_CallFunctionObjArgs(fail_if_dead, entry, call_id, future,
                                                        NULL);
        if (failed == NULL) {
            goto done;
        }
        Py_DECREF(failed);
    }
    status = 0;
done:
    Py_XDECREF(alive);
    Py_XDECREF(sent);
    Py_XDECREF(send);
    Py_XDECREF(calls);
    Py_XDECREF(entry);
    Py_DECREF(frame);
    return status;
}

static PyObject *
send_small(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "send_small() takes entries, ranks, call_id, future, "
                                         "prefix, tail and fail_if_dead");
        return NULL;
    }
    PyObject *entries = args[0], *ranks = args[1], *call_id = args[2], *future = args[3],
             *prefix = args[4], *tail = args[5], *fail_if_dead = args[6];
    if (!PyList_CheckExact(ranks) || !PyBytes_CheckExact(prefix) || !PyBytes_CheckExact(tail)) {
        PyErr_SetString(PyExc_TypeError, "send_small() takes a list of ranks and bytes");
        return NULL;
    }
    unsigned long long id = PyLong_AsUnsignedLongLong(call_id);
    if (id == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_INCREF(ranks);  /* held while the sends run Python */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ranks); i++) {
        PyObject *rank_obj = PyList_GET_ITEM(ranks, i);
        Py_INCREF(rank_obj);
        int status = send_one(entries, rank_obj, call_id, id, future, prefix, tail,
                              fail_if_dead);
        Py_DECREF(rank_obj);
        if (status < 0) {
            Py_DECREF(ranks);
            return NULL;
        }
    }
    Py_DECREF(ranks);
    Py_RETURN_NONE;
}

/* -- AnswerRouter ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *read;     /* the channel's read: a pair, a list of frames, or it raises */
    PyObject *by_rank;  /* the dispatcher's entries by rank (a dict, never replaced) */
    PyObject *channel;  /* the channel read: an entry routed here has it as its channel */
    /* what route_events read but did not route, for the pump's next call of this router:
     * a value (kept) or an error (its type, value and traceback) */
    PyObject *kept, *error_type, *error_value, *error_traceback;
} AnswerRouter;

static int
AnswerRouter_traverse(AnswerRouter *self, visitproc visit, void *arg)
{
    Py_VISIT(self->read);
    Py_VISIT(self->by_rank);
    Py_VISIT(self->channel);
    Py_VISIT(self->kept);
    Py_VISIT(self->error_type);
    Py_VISIT(self->error_value);
    Py_VISIT(self->error_traceback);
    return 0;
}

static int
AnswerRouter_clear(AnswerRouter *self)
{
    Py_CLEAR(self->read);
    Py_CLEAR(self->by_rank);
    Py_CLEAR(self->channel);
    Py_CLEAR(self->kept);
    Py_CLEAR(self->error_type);
    Py_CLEAR(self->error_value);
    Py_CLEAR(self->error_traceback);
    return 0;
}

static void
AnswerRouter_dealloc(AnswerRouter *self)
{
    PyObject_GC_UnTrack(self);
    AnswerRouter_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
AnswerRouter_init(AnswerRouter *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"read", "by_rank", "channel", NULL};
    PyObject *read, *by_rank, *channel;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!O", kwlist, &read, &PyDict_Type, &by_rank,
                                     &channel)) {
        return -1;
    }
    Py_INCREF(read);
    Py_INCREF(by_rank);
    Py_INCREF(channel);
    Py_XSETREF(self->read, read);
    Py_XSETREF(self->by_rank, by_rank);
    Py_XSETREF(self->channel, channel);
    return 0;
}

/* The entry's call ``id`` (its own, else its cohort's), or None: a new reference, NULL on
 * error. */
static PyObject *
take_call(PyObject *entry, PyObject *id)
{
    PyObject *calls = PyObject_GetAttr(entry, str_calls);
    if (calls == NULL) {
        return NULL;
    }
    PyObject *future;
    if (PyDict_CheckExact(calls)) {
        future = PyDict_GetItemWithError(calls, id);
        if (future != NULL) {
            Py_INCREF(future);
            if (PyDict_DelItem(calls, id) < 0) {
                Py_CLEAR(future);
            }
        }
        else if (!PyErr_Occurred()) {
            future = Py_NewRef(Py_None);
        }
    }
    else {
        future = PyObject_CallMethod(calls, "pop", "OO", id, Py_None);
    }
    Py_DECREF(calls);
    if (future != Py_None) {
        return future;
    }
    PyObject *cohorts = PyObject_GetAttr(entry, str_cohorts);
    int some = cohorts == NULL ? -1 : PyObject_IsTrue(cohorts);
    Py_XDECREF(cohorts);
    if (some <= 0) {
        if (some < 0) {
            Py_CLEAR(future);
        }
        return future;
    }
    Py_DECREF(future);
    return PyObject_CallMethodOneArg(entry, str_cohort_call, id);
}

/* Route ``pair`` as the pump would: 1 routed, 0 not an answer to route here (nothing done),
 * -1 on error. */
static int
route(AnswerRouter *self, PyObject *pair)
{
    PyObject *head = PyTuple_GET_ITEM(pair, 0), *payload = PyTuple_GET_ITEM(pair, 1);
    if (!PyBytes_CheckExact(head) || PyBytes_GET_SIZE(head) < HEAD_SIZE) {
        return 0;
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(head);
    if (p[0] != KIND_RESULT) {
        return 0;
    }
    PyObject *rank = PyLong_FromUnsignedLongLong(get_le(p + 9, 4));
    if (rank == NULL) {
        return -1;
    }
    int status = -1;
    PyObject *channel = NULL, *now = NULL, *id = NULL, *future = NULL;
    PyObject *entry = PyDict_GetItemWithError(self->by_rank, rank);
    if (entry == NULL) {
        status = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    Py_INCREF(entry);
    channel = PyObject_GetAttr(entry, str_channel);
    if (channel == NULL) {
        goto done;
    }
    if (channel != self->channel) {
        status = 0;
        goto done;
    }
    struct timespec ts;  /* time.monotonic()'s clock */
    clock_gettime(CLOCK_MONOTONIC, &ts);
    now = PyFloat_FromDouble((double)ts.tv_sec + (double)ts.tv_nsec * 1e-9);
    if (now == NULL || PyObject_SetAttr(entry, str_heard_at, now) < 0) {
        goto done;
    }
    id = PyLong_FromUnsignedLongLong(get_le(p + 1, 8));
    if (id == NULL || (future = take_call(entry, id)) == NULL) {
        goto done;
    }
    if (future != Py_None) {
        PyObject *call_args[3] = {future, rank, payload};
        PyObject *resolved = PyObject_VectorcallMethod(
            str_resolve_rank, call_args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (resolved == NULL) {
            goto done;
        }
        Py_DECREF(resolved);
    }
    status = 1;
done:
    Py_XDECREF(future);
    Py_XDECREF(id);
    Py_XDECREF(now);
    Py_XDECREF(channel);
    Py_XDECREF(entry);
    Py_DECREF(rank);
    return status;
}

/* read(), and a lone answer routed: [] where it was (a new reference), else what read()
 * returned; NULL with its error where it raised. */
static PyObject *
read_and_route(AnswerRouter *self)
{
    PyObject *got = PyObject_CallNoArgs(self->read);
    if (got == NULL || !PyTuple_CheckExact(got) || PyTuple_GET_SIZE(got) != 2) {
        return got;
    }
    int routed = route(self, got);
    if (routed == 0) {
        return got;
    }
    Py_DECREF(got);
    return routed < 0 ? NULL : PyList_New(0);
}

static PyObject *
AnswerRouter_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                        PyObject *kwnames)
{
    AnswerRouter *self = (AnswerRouter *)callable;
    (void)args;
    if (PyVectorcall_NARGS(nargsf) != 0 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "AnswerRouter() takes no arguments");
        return NULL;
    }
    if (self->kept != NULL) {  /* read by route_events: handed over now, once */
        PyObject *kept = self->kept;
        self->kept = NULL;
        return kept;
    }
    if (self->error_type != NULL) {
        PyErr_Restore(self->error_type, self->error_value, self->error_traceback);
        self->error_type = self->error_value = self->error_traceback = NULL;
        return NULL;
    }
    return read_and_route(self);
}

static PyObject *
AnswerRouter_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    AnswerRouter *self = (AnswerRouter *)PyType_GenericNew(type, args, kwds);
    if (self != NULL) {
        self->vectorcall = AnswerRouter_vectorcall;
    }
    return (PyObject *)self;
}

static PyObject *
AnswerRouter_call(PyObject *self, PyObject *args, PyObject *kwds)
{
    return PyVectorcall_Call(self, args, kwds);
}

/* Whether it holds a read route_events made and did not route (a value or an error). */
static int
router_holds(AnswerRouter *self)
{
    return self->kept != NULL || self->error_type != NULL;
}

static PyObject *
AnswerRouter_holds(AnswerRouter *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(router_holds(self));
}

static PyGetSetDef AnswerRouter_getset[] = {
    {"holds", (getter)AnswerRouter_holds, NULL,
     PyDoc_STR("Whether it holds a read that route_events made and did not route, for its "
               "next call."), NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject AnswerRouterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phalanx.controller._hotpath.AnswerRouter",
    .tp_doc = PyDoc_STR("AnswerRouter(read, by_rank, channel): read(), a lone answer routed "
                        "as the dispatcher's pump would; called with no arguments."),
    .tp_basicsize = sizeof(AnswerRouter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(AnswerRouter, vectorcall),
    .tp_new = AnswerRouter_new,
    .tp_init = (initproc)AnswerRouter_init,
    .tp_dealloc = (destructor)AnswerRouter_dealloc,
    .tp_traverse = (traverseproc)AnswerRouter_traverse,
    .tp_clear = (inquiry)AnswerRouter_clear,
    .tp_call = AnswerRouter_call,
    .tp_getset = AnswerRouter_getset,
};

/* -- route_events ------------------------------------------------------------------------ */

static PyObject *
route_events(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2 || !PyList_CheckExact(args[0]) || !PyDict_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "route_events() takes a poll's list of events and "
                                         "the watched descriptors' dict");
        return NULL;
    }
    PyObject *events = args[0], *by_fd = args[1];
    PyObject *rest = PyList_New(0);
    if (rest == NULL) {
        return NULL;
    }
    int read = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
        PyObject *event = PyList_GET_ITEM(events, i);
        PyObject *watched = NULL;
        if (PyTuple_CheckExact(event) && PyTuple_GET_SIZE(event) == 2) {
            watched = PyDict_GetItemWithError(by_fd, PyTuple_GET_ITEM(event, 0));
            if (watched == NULL && PyErr_Occurred()) {
                Py_DECREF(rest);
                return NULL;
            }
        }
        AnswerRouter *router = NULL;
        if (watched != NULL && PyTuple_CheckExact(watched) && PyTuple_GET_SIZE(watched) == 2
            && Py_IS_TYPE(PyTuple_GET_ITEM(watched, 1), &AnswerRouterType)) {
            router = (AnswerRouter *)PyTuple_GET_ITEM(watched, 1);
        }
        if (router == NULL || router_holds(router)) {
            if (PyList_Append(rest, event) < 0) {  /* the pump's Python takes it */
                Py_DECREF(rest);
                return NULL;
            }
            continue;
        }
        Py_INCREF(router);  /* (routing runs Python, which may unwatch it) */
        read = 1;
        PyObject *got = read_and_route(router);
        int handled = got != NULL && PyList_CheckExact(got) && PyList_GET_SIZE(got) == 0;
        if (handled) {
            Py_DECREF(got);
        }
        else {
            if (got == NULL) {  /* raised: the pump's call of the router raises it */
                PyErr_Fetch(&router->error_type, &router->error_value,
                            &router->error_traceback);
            }
            router->kept = got;  /* (NULL where it raised) */
            if (PyList_Append(rest, event) < 0) {
                Py_DECREF(router);
                Py_DECREF(rest);
                return NULL;
            }
        }
        Py_DECREF(router);
    }
    PyObject *out = Py_BuildValue("(NO)", rest, read ? Py_True : Py_False);
    return out;
}

static PyMethodDef hotpath_functions[] = {
    {"route_events", (PyCFunction)(void (*)(void))route_events, METH_FASTCALL,
     PyDoc_STR("route_events(events, by_fd): the pump's loop over a poll's events for the "
               "lone answers its routers route, compiled: (the events left, whether any "
               "was read).")},
    {"send_small", (PyCFunction)(void (*)(void))send_small, METH_FASTCALL,
     PyDoc_STR("send_small(entries, ranks, call_id, future, prefix, tail, fail_if_dead): "
               "Sender._deliver of protocol.small_call_frames, compiled.")},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hotpath_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "phalanx.controller._hotpath",
    .m_doc = PyDoc_STR("Compiled twins of the controller's per-rank steps of a plain call."),
    .m_size = -1,
    .m_methods = hotpath_functions,
};

#define INTERN(var, text)                                        \
    do {                                                         \
        if ((var = PyUnicode_InternFromString(text)) == NULL) { \
            return NULL;                                         \
        }                                                        \
    } while (0)

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    INTERN(str_calls, "calls");
    INTERN(str_send, "send");
    INTERN(str_alive, "alive");
    INTERN(str_channel, "channel");
    INTERN(str_heard_at, "heard_at");
    INTERN(str_cohorts, "cohorts");
    INTERN(str_cohort_call, "cohort_call");
    INTERN(str_resolve_rank, "resolve_rank");
    if (PyType_Ready(&AnswerRouterType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&hotpath_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&AnswerRouterType);
    if (PyModule_AddObject(module, "AnswerRouter", (PyObject *)&AnswerRouterType) < 0) {
        Py_DECREF(&AnswerRouterType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
