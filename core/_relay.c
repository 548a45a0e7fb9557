/* The compiled relay: a stream's token events moved from the engine's socket to the client's
 * in C, on the event loop's own thread (see core/compiled_relay.py for the contract).
 *
 * A Relay is an epoll set of adopted engine sockets. The asyncio loop watches the set's one
 * descriptor; when it is readable Python calls run() once, which reads every ready engine
 * socket, takes its whole HTTP/1.1 chunks, splits their bytes into SSE events and, for each
 * event of the stream's learned token shape (the same bytes before and after a valid JSON
 * string), adds it, chunk-framed, to the client's bytes of this turn; then writes each
 * client once. Nothing per event touches a Python object.
 *
 * A client whose socket is full holds its stream back: what was framed for it is kept, the
 * engine's socket is not read (the kernel's buffers, then the engine's own flow control,
 * hold the rest) until the client's socket is writable again, watched in the same set.
 *
 * Anything else gives the stream back to Python (run() returns it): an event of another
 * shape (the finish, the usage, an error; a tail whose digits moved on, llama-server's
 * "created", is still the shape), a chunk it does not take (the body's end, an extension,
 * a malformed size), the engine's end of file or a read error, a failed client write (the
 * client gone), or Python reclaiming it. What is given back is exact: the events relayed since
 * the last hand (for the generation's log), the engine bytes not relayed, chunk-framed from
 * a chunk's start (Python's HTTP parser reads on from them), and the client bytes not
 * written. Relayed events past the hold's bound (MAX_RELAYED_HELD) are delivered to Python
 * without giving the stream back: run() returns them as a give-back with None for the
 * engine's bytes. Both sockets are duplicated at adoption, so a descriptor number the loop closes
 * and reuses meanwhile is never written to; the duplicates are closed at the give-back.
 *
 * The parsing (chunks, events, the shape) is one sans-IO scanner, scan_body(), apart from
 * the sockets: the relay's loop runs it on each stream's engine bytes, and the module's
 * scan() runs it on bytes alone, so that the parser is tested without sockets
 * (tests/unit/test_relay_scanner.py) and fuzzed under the sanitizers (tests/fuzz/).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define READ_SIZE 65536
#define MAX_SIZE_LINE 16   /* hex digits of a chunk size (a 64-bit size, no extension) */
#define MAX_PENDING 65536  /* undelimited event bytes before the stream is given back */
#define MAX_EVENTS 512     /* ready sockets taken per epoll_wait */
/* An engine's bytes read in one turn: an engine that writes faster than the relay copies
 * would otherwise keep one run() reading (every other stream, and the loop, waiting) and
 * its buffers growing. The rest is read next turn (epoll is level-triggered). */
#define MAX_READ_PER_TURN (4 * READ_SIZE)
/* The engine bytes one run() reads, all its streams together, past the floors
 * (MIN_READ_PER_RUN) of the streams that are not flooding: a flooding stream reads from
 * this budget alone, so ten engines flooding cost every other stream, and the loop, about
 * as much per turn as one. Its ready engine sockets are read from a start that moves on
 * every run, so the budget goes to each flood in turn; what a socket did not read is there
 * next run (epoll is level-triggered). The default of the constructor's read_per_run (a
 * relay's own budget, never below MIN_READ_PER_RUN). */
#define MAX_READ_PER_RUN (16 * 1024)
/* What every ready engine socket that is not flooding may read in a run, the budget spent
 * or not: a stream that writes a token at a time is never kept waiting behind the floods
 * for its turn. A stream is flooding while its last read filled the allowance it was given
 * (it stopped at the allowance, not at an empty socket); a flood gets no floor, or its
 * floor, times the floods, would be read every run past the budget. */
#define MIN_READ_PER_RUN 4096
/* The relayed events a stream's hold keeps for the generation's log: past this run()
 * delivers them to Python (the stream stays adopted), so that the log is never far behind
 * and taking them into it is never a long stall of the loop (Python takes a delivery in one
 * step, at about a microsecond per event). A flood stays here, at its bounded share of
 * each run, instead of going back to Python's costlier path per event. The default of the
 * constructor's hold_bytes (a relay's own bound, at least a byte). */
#define MAX_RELAYED_HELD (64 * 1024)

typedef struct {
    char *p;
    size_t len, cap;
} buf_t;

/* Room for n more bytes: the appends after it cannot fail. */
static int buf_reserve(buf_t *b, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        while (cap < b->len + n) cap *= 2;
        char *p = realloc(b->p, cap);
        if (p == NULL) return -1;
        b->p = p;
        b->cap = cap;
    }
    return 0;
}

static int buf_append(buf_t *b, const char *d, size_t n) {
    if (buf_reserve(b, n) < 0) return -1;
    if (n) memcpy(b->p + b->len, d, n);
    b->len += n;
    return 0;
}

static void buf_consume(buf_t *b, size_t n) {
    if (n >= b->len) {
        b->len = 0;
        return;
    }
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
}

/* A chunk's size line for n bytes ("%zx\r\n"): its length, at most 18. */
static size_t size_line(char *line, size_t n) {
    char digits[2 * sizeof n];
    size_t k = 0;
    do {
        digits[k++] = "0123456789abcdef"[n & 15];
        n >>= 4;
    } while (n);
    for (size_t i = 0; i < k; i++) line[i] = digits[k - 1 - i];
    line[k] = '\r';
    line[k + 1] = '\n';
    return k + 2;
}

/* ---- The scanner: HTTP/1.1 chunks, SSE events, the token shape. No socket, no Python. ---- */

static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Whether p[0:n] is the body of a JSON string of one character or more that needs no
 * decoding beyond the two-character escapes: no control character, no unescaped quote,
 * no \u escape (those streams' events go through Python), well-formed UTF-8 (no
 * surrogate, no overlong form). Anything it accepts, a JSON parser reads as a string. */
static int plain_json_text_c(const unsigned char *p, size_t n) {
    if (n == 0) return 0;
    size_t i = 0;
    while (i < n) {
        unsigned char c = p[i];
        if (c < 0x20 || c == '"') return 0;
        if (c == '\\') {
            if (i + 1 >= n) return 0;
            switch (p[i + 1]) {
            case '"': case '\\': case '/': case 'b': case 'f': case 'n': case 'r': case 't':
                i += 2;
                continue;
            default:
                return 0;
            }
        }
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t k;
        unsigned int cp;
        if ((c & 0xE0) == 0xC0) {
            k = 1;
            cp = c & 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            k = 2;
            cp = c & 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            k = 3;
            cp = c & 0x07;
        } else {
            return 0;
        }
        if (i + k >= n) return 0;
        for (size_t j = 1; j <= k; j++) {
            if ((p[i + j] & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (p[i + j] & 0x3F);
        }
        if ((k == 1 && cp < 0x80) || (k == 2 && cp < 0x800) || (k == 3 && cp < 0x10000) ||
            cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
        i += k + 1;
    }
    return 1;
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }

/* Whether an event's tail is the learned one, but for digits that are not the first of
 * their run (llama-server's "created" moves on every second): the same JSON, a number's
 * or a string's digits changed, never a number's leading digit (no new leading zero). */
static int same_tail(const char *e, const char *t, size_t n) {
    if (memcmp(e, t, n) == 0) return 1;
    for (size_t i = 0; i < n; i++) {
        if (e[i] == t[i]) continue;
        if (i == 0 || !is_digit(e[i]) || !is_digit(t[i]) || !is_digit(e[i - 1])) return 0;
    }
    return 1;
}

/* A stream's learned token shape: an event is head, a plain JSON text, tail. */
typedef struct {
    const char *head, *tail;
    size_t head_len, tail_len;
} shape_t;

static int is_token_event(const shape_t *shape, const char *e, size_t n) {
    if (n < shape->head_len + shape->tail_len + 1) return 0;
    if (memcmp(e, shape->head, shape->head_len) != 0) return 0;
    if (!same_tail(e + n - shape->tail_len, shape->tail, shape->tail_len)) return 0;
    return plain_json_text_c((const unsigned char *)e + shape->head_len,
                             n - shape->head_len - shape->tail_len);
}

/* Why a scan stopped. Every reason but SCAN_MORE gives the stream back to Python; the
 * names (scan_stops) are what Python's scan() says. */
typedef enum {
    SCAN_MORE,     /* every whole chunk taken: the rest needs more bytes */
    SCAN_EVENT,    /* an event not of the token shape (the finish, the usage, an error) */
    SCAN_CR,       /* a carriage return in an event not whole yet (CRLF endings, say) */
    SCAN_SIZE,     /* a size line it does not take: empty, over MAX_SIZE_LINE digits, an
                    * extension or another non-hex byte, a CR not followed by LF */
    SCAN_FRAMING,  /* a chunk's data not followed by CRLF */
    SCAN_END,      /* the last chunk (size 0): the body's end, Python's parser reads it */
    SCAN_TOO_LONG, /* a chunk, or an event not whole yet, over MAX_PENDING bytes */
    SCAN_MEMORY,   /* out of memory, or the taker refused the event */
    SCAN_STOPS
} scan_stop_t;

static const char *const scan_stops[SCAN_STOPS] = {
    "more", "event", "cr", "size", "framing", "end", "too-long", "memory",
};

/* Takes one token event, in order: its bytes are valid during the call only. Nonzero:
 * the event is not taken (it stays in the carry) and the scan stops with SCAN_MEMORY. */
typedef int (*take_event_t)(void *ctx, const char *event, size_t n);

typedef struct {
    size_t consumed;   /* input bytes taken: whole chunks, from the input's start */
    size_t events;     /* token events taken */
    scan_stop_t stop;
} scan_t;

/* Where the first blank line ("\n\n") in p[0:n] starts, or NULL. memchr is vectorized
 * where glibc's memmem, for a two-byte needle, walks byte by byte: an event holds one
 * newline before its end, so this is one memchr per event, plus one for the blank line. */
static const char *blank_line(const char *p, size_t n) {
    const char *end = p + n;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        if (nl == NULL || nl + 1 >= end) return NULL;
        if (nl[1] == '\n') return nl;
        p = nl + 1;
    }
    return NULL;
}

/* The whole events at the start of carry that are tokens, taken and removed; the carry
 * then starts at an event (the one not taken, or one not whole yet). */
static scan_stop_t scan_events(const shape_t *shape, buf_t *carry, take_event_t take,
                               void *ctx, size_t *events) {
    scan_stop_t stop = SCAN_MORE;
    size_t at = 0;
    for (;;) {
        const char *start = carry->p + at;
        const char *end = blank_line(start, carry->len - at);
        if (end == NULL) break;
        size_t n = (size_t)(end - start) + 2;
        if (!is_token_event(shape, start, n)) {
            stop = SCAN_EVENT;
            break;
        }
        if (take(ctx, start, n) != 0) {
            stop = SCAN_MEMORY;
            break;
        }
        (*events)++;
        at += n;
    }
    buf_consume(carry, at);
    if (stop == SCAN_MORE && carry->len > MAX_PENDING) stop = SCAN_TOO_LONG;
    /* A token event never holds a carriage return (JSON escapes it): one in what waits is
     * an event this lane does not take (CRLF line ends, say), given back now rather than
     * when MAX_PENDING bytes have piled up behind it. */
    if (stop == SCAN_MORE && carry->len && memchr(carry->p, '\r', carry->len) != NULL)
        stop = SCAN_CR;
    return stop;
}

/* The sans-IO scanner. in[0:len] is a chunked body's bytes from a chunk's start; carry
 * holds the bytes of whole chunks already scanned that are not whole events yet (empty
 * at a body's start; the scan appends to it and takes from it). Each whole chunk's data
 * goes to the carry, and each whole token event at the carry's start to take(), until a
 * chunk is not whole (SCAN_MORE) or something is not the lane's (any other stop). What
 * was not consumed starts at a chunk's start; framed as one chunk ahead of it, the carry
 * gives back the rest of the body exactly. The same bytes cut anywhere into successive
 * scans take the same events and consume the same total (only whole chunks are read). */
static scan_t scan_body(const shape_t *shape, buf_t *carry, const char *in, size_t len,
                        take_event_t take, void *ctx) {
    scan_t res = {0, 0, SCAN_MORE};
    while (res.stop == SCAN_MORE && res.consumed < len) {
        const char *r = in + res.consumed;
        size_t left = len - res.consumed;
        size_t line = 0;
        while (line < left && line <= MAX_SIZE_LINE && r[line] != '\r') line++;
        if (line > MAX_SIZE_LINE || line == 0) {
            res.stop = SCAN_SIZE;
            break;
        }
        if (line + 1 >= left) break; /* the size line is not whole yet */
        if (r[line + 1] != '\n') {
            res.stop = SCAN_SIZE;
            break;
        }
        uint64_t size = 0;
        for (size_t i = 0; i < line; i++) {
            int v = hex_digit(r[i]);
            if (v < 0) {
                res.stop = SCAN_SIZE; /* an extension, or not a size: the parser's to judge */
                break;
            }
            size = size * 16 + (uint64_t)v;
        }
        if (res.stop != SCAN_MORE) break;
        if (size == 0) {
            res.stop = SCAN_END;
            break;
        }
        if (size > MAX_PENDING) {
            res.stop = SCAN_TOO_LONG;
            break;
        }
        if (left - line - 2 < size + 2) break; /* the chunk is not whole yet */
        if (r[line + 2 + size] != '\r' || r[line + 3 + size] != '\n') {
            res.stop = SCAN_FRAMING;
            break;
        }
        if (buf_append(carry, r + line + 2, (size_t)size) < 0) {
            res.stop = SCAN_MEMORY;
            break;
        }
        res.consumed += line + 2 + (size_t)size + 2;
        res.stop = scan_events(shape, carry, take, ctx, &res.events);
    }
    return res;
}

/* ---- The relay: the scanner between an engine's socket and a client's. ---- */

struct stream;

/* What an epoll registration points at: one of a stream's two sockets. */
typedef struct {
    struct stream *stream;
    int client;
} endpoint_t;

typedef struct stream {
    struct stream *prev, *next; /* the relay's adopted streams */
    struct stream *ready;       /* this turn's */
    int engine_fd, client_fd;   /* duplicates, owned */
    PyObject *hold;
    char *head, *tail;
    size_t head_len, tail_len;
    buf_t raw;     /* engine bytes not taken yet, from a chunk's start */
    buf_t sse;     /* the scanner's carry: bytes of whole chunks not taken as events yet */
    buf_t out;     /* chunk-framed events for the client, not written yet */
    buf_t relayed; /* the events relayed since the last hand, as the engine sent them */
    buf_t texts;   /* their texts' JSON string bodies, joined: one JSON string's body */
    Py_ssize_t count;
    double last_read, last_write;
    endpoint_t engine_end, client_end;
    int done;
    int blocked; /* the client's socket is full: the engine is not read until it drains */
    int queued;  /* on this turn's list */
    int flooding; /* its last read filled its allowance: it reads from the budget alone */
} stream_t;

typedef struct {
    PyObject_HEAD
    int epfd;
    stream_t *streams;
    unsigned turn;       /* where the next run starts reading */
    size_t read_per_run; /* engine bytes a run reads past the floors of non-floods */
    size_t held;         /* relayed bytes a stream keeps before run() delivers them */
} Relay;

static double monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void stream_free(stream_t *s) {
    if (s->engine_fd >= 0) close(s->engine_fd);
    if (s->client_fd >= 0) close(s->client_fd);
    free(s->raw.p);
    free(s->sse.p);
    free(s->out.p);
    free(s->relayed.p);
    free(s->texts.p);
    free(s->head);
    free(s->tail);
    Py_XDECREF(s->hold);
    free(s);
}

/* The scanner's taker for a stream: the event framed for the client and kept for the
 * generation's log, with its text (the bytes between the shape's head and tail, a JSON
 * string's body), all or none (the room is made first). */
static int frame_event(void *ctx, const char *event, size_t n) {
    stream_t *s = ctx;
    char line[24];
    size_t h = size_line(line, n);
    size_t text = n - s->head_len - s->tail_len; /* the scanner took it: at least 1 */
    if (buf_reserve(&s->out, h + n + 2) < 0 || buf_reserve(&s->relayed, n) < 0 ||
        buf_reserve(&s->texts, text) < 0)
        return -1;
    buf_append(&s->out, line, h);
    buf_append(&s->out, event, n);
    buf_append(&s->out, "\r\n", 2);
    buf_append(&s->relayed, event, n);
    buf_append(&s->texts, event + s->head_len, text);
    return 0;
}

/* Whole chunks from s->raw into the scanner, its events into s->out, until done or short. */
static void take_chunks(stream_t *s) {
    if (s->done) return;
    shape_t shape = {s->head, s->tail, s->head_len, s->tail_len};
    scan_t res = scan_body(&shape, &s->sse, s->raw.p, s->raw.len, frame_event, s);
    s->count += (Py_ssize_t)res.events;
    buf_consume(&s->raw, res.consumed);
    if (res.stop != SCAN_MORE) s->done = 1;
}

/* Reads until a short read (one recv per event, mostly), or ``allowance`` bytes; the
 * peer's end (EPOLLRDHUP, EPOLLHUP, EPOLLERR in ``events``) gives the stream back after
 * what is there. Returns the bytes read. */
static size_t read_engine(stream_t *s, uint32_t events, size_t allowance) {
    char tmp[READ_SIZE];
    int ended = (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) != 0;
    size_t taken = 0;
    for (;;) {
        size_t want = allowance - taken < sizeof tmp ? allowance - taken : sizeof tmp;
        ssize_t r = recv(s->engine_fd, tmp, want, MSG_DONTWAIT);
        if (r > 0) {
            s->last_read = monotonic();
            if (buf_append(&s->raw, tmp, (size_t)r) < 0) {
                s->done = 1;
                return taken;
            }
            taken += (size_t)r;
            if ((size_t)r < want) break;
            if (taken >= allowance) {
                ended = 0; /* more is there: its end, if it came, is seen next turn */
                break;
            }
            continue;
        }
        if (r == 0) {
            ended = 1; /* the end of file stays: Python's read finds it again */
        } else if (errno == EINTR) {
            continue;
        } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
            ended = 1; /* so does the error (its own read fails the same way) */
        }
        break;
    }
    take_chunks(s); /* what arrived before the end is relayed as any other */
    if (ended) s->done = 1;
    return taken;
}

/* A client that does not take a write whole: the engine is not read (the kernel's
 * buffers and then the engine's own flow control hold the rest) until the client's socket
 * is writable again; the bytes kept stay in order. */
static void block(Relay *relay, stream_t *s) {
    struct epoll_event engine = {.events = 0, .data.ptr = &s->engine_end};
    struct epoll_event client = {.events = EPOLLOUT, .data.ptr = &s->client_end};
    if (epoll_ctl(relay->epfd, EPOLL_CTL_MOD, s->engine_fd, &engine) < 0 ||
        epoll_ctl(relay->epfd, EPOLL_CTL_ADD, s->client_fd, &client) < 0) {
        s->done = 1; /* Python's transport has the rest */
        return;
    }
    s->blocked = 1;
}

static void unblock(Relay *relay, stream_t *s) {
    struct epoll_event engine = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = &s->engine_end};
    epoll_ctl(relay->epfd, EPOLL_CTL_DEL, s->client_fd, NULL);
    s->blocked = 0;
    if (epoll_ctl(relay->epfd, EPOLL_CTL_MOD, s->engine_fd, &engine) < 0) s->done = 1;
}

static void write_client(Relay *relay, stream_t *s) {
    size_t sent = 0;
    int full = 0;
    while (sent < s->out.len) {
        ssize_t w = send(s->client_fd, s->out.p + sent, s->out.len - sent,
                         MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w > 0) {
            sent += (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) full = 1;
        else s->done = 1; /* the client is gone: Python's write finds out and says so */
        break;
    }
    if (sent) s->last_write = monotonic();
    buf_consume(&s->out, sent);
    if (s->done) return;
    if (full && !s->blocked) block(relay, s);
    else if (!s->out.len && s->blocked) unblock(relay, s);
}

static void unlink_stream(Relay *relay, stream_t *s) {
    epoll_ctl(relay->epfd, EPOLL_CTL_DEL, s->engine_fd, NULL);
    if (s->blocked) epoll_ctl(relay->epfd, EPOLL_CTL_DEL, s->client_fd, NULL);
    s->blocked = 0;
    if (s->prev) s->prev->next = s->next;
    else relay->streams = s->next;
    if (s->next) s->next->prev = s->prev;
    s->prev = s->next = NULL;
}

/* (hold, relayed, count, engine_bytes, unsent, last_read, last_write, texts), or NULL with an
 * exception; the stream stays adopted either way (``release`` frees it once the tuple is
 * in Python's hands: a stream is never freed without being handed back). */
static PyObject *handing(stream_t *s) {
    PyObject *engine;
    if (s->sse.len) {
        char line[24];
        size_t h = size_line(line, s->sse.len);
        size_t total = h + s->sse.len + 2 + s->raw.len;
        engine = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
        if (engine) {
            char *g = PyBytes_AS_STRING(engine);
            memcpy(g, line, h);
            memcpy(g + h, s->sse.p, s->sse.len);
            memcpy(g + h + s->sse.len, "\r\n", 2);
            if (s->raw.len) memcpy(g + h + s->sse.len + 2, s->raw.p, s->raw.len);
        }
    } else {
        engine = PyBytes_FromStringAndSize(s->raw.p ? s->raw.p : "", (Py_ssize_t)s->raw.len);
    }
    PyObject *item = NULL;
    if (engine) {
        item = Py_BuildValue("(Oy#nNy#ddy#)", s->hold, s->relayed.p ? s->relayed.p : "",
                             (Py_ssize_t)s->relayed.len, s->count, engine,
                             s->out.p ? s->out.p : "", (Py_ssize_t)s->out.len, s->last_read,
                             s->last_write, s->texts.p ? s->texts.p : "",
                             (Py_ssize_t)s->texts.len);
    }
    return item;
}

/* (hold, relayed, count, None, b"", last_read, last_write, texts): the events relayed since
 * the last hand, delivered while the stream stays adopted (None where a give-back has the
 * engine's bytes), or NULL with an exception. The stream keeps them until ``delivered``. */
static PyObject *delivering(stream_t *s) {
    return Py_BuildValue("(Oy#nOy#ddy#)", s->hold, s->relayed.p, (Py_ssize_t)s->relayed.len,
                         s->count, Py_None, "", (Py_ssize_t)0, s->last_read, s->last_write,
                         s->texts.p, (Py_ssize_t)s->texts.len);
}

/* The delivery is in Python's hands: the next one starts empty. */
static void delivered(stream_t *s) {
    buf_consume(&s->relayed, s->relayed.len);
    buf_consume(&s->texts, s->texts.len);
    s->count = 0;
}

static void release(Relay *relay, stream_t *s) {
    unlink_stream(relay, s);
    stream_free(s);
}

static PyObject *Relay_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"read_per_run", "hold_bytes", NULL};
    Py_ssize_t read_per_run = MAX_READ_PER_RUN, held = MAX_RELAYED_HELD;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$nn:Relay", kwlist, &read_per_run, &held))
        return NULL;
    if (read_per_run < MIN_READ_PER_RUN) {
        PyErr_Format(PyExc_ValueError, "read_per_run must be at least %d (MIN_READ_PER_RUN)",
                     MIN_READ_PER_RUN);
        return NULL;
    }
    if (held < 1) {
        PyErr_SetString(PyExc_ValueError, "hold_bytes must be at least 1");
        return NULL;
    }
    Relay *self = (Relay *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->streams = NULL;
    self->turn = 0;
    self->read_per_run = (size_t)read_per_run;
    self->held = (size_t)held;
    self->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (self->epfd < 0) {
        Py_DECREF(self);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)self;
}

static void drop_all(Relay *self) {
    while (self->streams) {
        stream_t *s = self->streams;
        unlink_stream(self, s);
        stream_free(s);
    }
}

static void Relay_dealloc(Relay *self) {
    drop_all(self);
    if (self->epfd >= 0) close(self->epfd);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Relay_fileno(Relay *self, PyObject *Py_UNUSED(unused)) {
    if (self->epfd < 0) {
        PyErr_SetString(PyExc_ValueError, "the compiled relay is closed");
        return NULL;
    }
    return PyLong_FromLong(self->epfd);
}

static PyObject *Relay_adopt(Relay *self, PyObject *args) {
    int engine_fd, client_fd;
    const char *head, *tail;
    Py_ssize_t head_len, tail_len;
    PyObject *hold;
    if (!PyArg_ParseTuple(args, "iiy#y#O:adopt", &engine_fd, &client_fd, &head, &head_len,
                          &tail, &tail_len, &hold))
        return NULL;
    if (self->epfd < 0) {
        PyErr_SetString(PyExc_ValueError, "the compiled relay is closed");
        return NULL;
    }
    if (head_len == 0 || tail_len == 0) {
        PyErr_SetString(PyExc_ValueError, "a token shape needs a head and a tail");
        return NULL;
    }
    stream_t *s = calloc(1, sizeof *s);
    if (s == NULL) return PyErr_NoMemory();
    s->engine_fd = s->client_fd = -1;
    s->head = malloc((size_t)head_len);
    s->tail = malloc((size_t)tail_len);
    if (s->head == NULL || s->tail == NULL) {
        stream_free(s);
        return PyErr_NoMemory();
    }
    memcpy(s->head, head, (size_t)head_len);
    memcpy(s->tail, tail, (size_t)tail_len);
    s->head_len = (size_t)head_len;
    s->tail_len = (size_t)tail_len;
    s->last_read = s->last_write = monotonic();
    s->engine_fd = fcntl(engine_fd, F_DUPFD_CLOEXEC, 0);
    s->client_fd = fcntl(client_fd, F_DUPFD_CLOEXEC, 0);
    s->engine_end.stream = s->client_end.stream = s;
    s->client_end.client = 1;
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = &s->engine_end};
    if (s->engine_fd < 0 || s->client_fd < 0 ||
        epoll_ctl(self->epfd, EPOLL_CTL_ADD, s->engine_fd, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        stream_free(s);
        return NULL;
    }
    Py_INCREF(hold);
    s->hold = hold;
    s->next = self->streams;
    if (self->streams) self->streams->prev = s;
    self->streams = s;
    Py_RETURN_NONE;
}

static PyObject *Relay_run(Relay *self, PyObject *Py_UNUSED(unused)) {
    PyObject *back = PyList_New(0);
    if (back == NULL || self->epfd < 0) return back;
    struct epoll_event events[MAX_EVENTS];
    int n = epoll_wait(self->epfd, events, MAX_EVENTS, 0);
    if (n < 0) {
        if (errno == EINTR) return back;
        Py_DECREF(back);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    stream_t *ready = NULL;
    size_t budget = self->read_per_run;
    int start = n > 0 ? (int)(self->turn++ % (unsigned)n) : 0;
    for (int k = 0; k < n; k++) {
        int i = (start + k) % n;
        endpoint_t *end = events[i].data.ptr;
        stream_t *s = end->stream;
        if (!end->client) {
            size_t allowance = budget < MAX_READ_PER_TURN ? budget : MAX_READ_PER_TURN;
            if (!s->flooding && allowance < MIN_READ_PER_RUN) allowance = MIN_READ_PER_RUN;
            /* A flood with no budget left is not read (recv of 0 bytes would read as its
             * end): it is reported again next run, and its client is written as ever. */
            if (allowance) {
                size_t taken = read_engine(s, events[i].events, allowance);
                /* read_engine stops short of the allowance only at an empty socket, its
                 * end or an error: a stream stops flooding at its first such read. */
                s->flooding = taken >= allowance;
                budget = taken >= budget ? 0 : budget - taken;
            }
        }
        if (!s->queued) {
            s->queued = 1;
            s->ready = ready;
            ready = s;
        }
    }
    /* Every client written once, after every read of the turn. */
    for (stream_t *s = ready, *next; s != NULL; s = next) {
        next = s->ready;
        s->queued = 0;
        if (s->out.len) write_client(self, s);
        int delivery = !s->done && s->relayed.len >= self->held;
        if (!s->done && !delivery) continue;
        PyObject *item = delivery ? delivering(s) : handing(s);
        if (item == NULL || PyList_Append(back, item) < 0) {
            /* This stream and the rest stay adopted with what they relayed: handed at
             * their next read, or by reclaim() (the heartbeat's), never lost. */
            Py_XDECREF(item);
            for (stream_t *rest = next; rest != NULL; rest = rest->ready) rest->queued = 0;
            Py_DECREF(back);
            return NULL;
        }
        if (delivery) delivered(s);
        else release(self, s);
        Py_DECREF(item);
    }
    return back;
}

static PyObject *Relay_reclaim(Relay *self, PyObject *hold) {
    for (stream_t *s = self->streams; s != NULL; s = s->next) {
        if (s->hold == hold) {
            PyObject *item = handing(s);
            if (item != NULL) release(self, s);
            return item;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *Relay_drop(Relay *self, PyObject *hold) {
    for (stream_t *s = self->streams; s != NULL; s = s->next) {
        if (s->hold == hold) {
            unlink_stream(self, s);
            stream_free(s);
            Py_RETURN_TRUE;
        }
    }
    Py_RETURN_FALSE;
}

static PyObject *Relay_close(Relay *self, PyObject *Py_UNUSED(unused)) {
    drop_all(self);
    if (self->epfd >= 0) close(self->epfd);
    self->epfd = -1;
    Py_RETURN_NONE;
}

static PyObject *Relay_len(Relay *self, PyObject *Py_UNUSED(unused)) {
    Py_ssize_t n = 0;
    for (stream_t *s = self->streams; s != NULL; s = s->next) n++;
    return PyLong_FromSsize_t(n);
}

static PyObject *plain_text_py(PyObject *Py_UNUSED(module), PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    int ok = plain_json_text_c(view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

/* scan()'s taker: each event taken, a bytes object on the list. */
static int list_event(void *ctx, const char *event, size_t n) {
    PyObject *item = PyBytes_FromStringAndSize(event, (Py_ssize_t)n);
    if (item == NULL) return -1;
    int failed = PyList_Append((PyObject *)ctx, item);
    Py_DECREF(item);
    return failed;
}

static PyObject *scan_py(PyObject *Py_UNUSED(module), PyObject *args) {
    Py_buffer data, head, tail, carried = {.buf = NULL, .obj = NULL, .len = 0};
    if (!PyArg_ParseTuple(args, "y*y*y*|y*:scan", &data, &head, &tail, &carried)) return NULL;
    PyObject *result = NULL, *events = NULL;
    buf_t carry = {NULL, 0, 0};
    if (head.len == 0 || tail.len == 0) {
        PyErr_SetString(PyExc_ValueError, "a token shape needs a head and a tail");
        goto out;
    }
    events = PyList_New(0);
    if (events == NULL) goto out;
    if (buf_append(&carry, carried.buf, (size_t)carried.len) < 0) {
        PyErr_NoMemory();
        goto out;
    }
    {
        shape_t shape = {head.buf, tail.buf, (size_t)head.len, (size_t)tail.len};
        scan_t res = scan_body(&shape, &carry, data.buf, (size_t)data.len, list_event, events);
        if (res.stop == SCAN_MEMORY) {
            if (!PyErr_Occurred()) PyErr_NoMemory();
            goto out;
        }
        result = Py_BuildValue("(nOy#s)", (Py_ssize_t)res.consumed, events,
                               carry.p ? carry.p : "", (Py_ssize_t)carry.len,
                               scan_stops[res.stop]);
    }
out:
    free(carry.p);
    Py_XDECREF(events);
    PyBuffer_Release(&data);
    PyBuffer_Release(&head);
    PyBuffer_Release(&tail);
    PyBuffer_Release(&carried);
    return result;
}

static PyMethodDef Relay_methods[] = {
    {"fileno", (PyCFunction)Relay_fileno, METH_NOARGS,
     "The epoll descriptor the event loop watches."},
    {"adopt", (PyCFunction)Relay_adopt, METH_VARARGS,
     "adopt(engine_fd, client_fd, head, tail, hold): relay the stream's token events."},
    {"run", (PyCFunction)Relay_run, METH_NOARGS,
     "One turn: relay what is ready; the streams given back."},
    {"reclaim", (PyCFunction)Relay_reclaim, METH_O,
     "reclaim(hold): give the stream back now (None if the compiled relay does not hold it)."},
    {"drop", (PyCFunction)Relay_drop, METH_O,
     "drop(hold): forget the stream, giving nothing back (its connection is closing)."},
    {"close", (PyCFunction)Relay_close, METH_NOARGS, "Forget every stream; close the set."},
    {"held", (PyCFunction)Relay_len, METH_NOARGS, "How many streams the compiled relay holds."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RelayType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefixpin.core._relay.Relay",
    .tp_basicsize = sizeof(Relay),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Relay(*, read_per_run=MAX_READ_PER_RUN, hold_bytes=MAX_RELAYED_HELD): token events\n"
              "relayed between sockets in C (core/compiled_relay.py).",
    .tp_new = Relay_new,
    .tp_dealloc = (destructor)Relay_dealloc,
    .tp_methods = Relay_methods,
};

static PyMethodDef module_methods[] = {
    {"plain_json_text", (PyCFunction)plain_text_py, METH_O,
     "Whether the bytes are a JSON string's body the relay takes as a token's text."},
    {"scan", (PyCFunction)scan_py, METH_VARARGS,
     "scan($module, data, head, tail, carry=b'', /)\n--\n\n"
     "-> (consumed, events, carry, stop): the relay's own scanner on bytes alone.\n\n"
     "data: a chunked body from a chunk's start; head, tail: the token shape; carry: what\n"
     "the previous scan returned (b'' at a body's start). consumed: the bytes of data taken\n"
     "(whole chunks); events: the token events taken, in order; carry: bytes of whole\n"
     "chunks not taken as events yet (for the next scan, with data[consumed:] and more);\n"
     "stop: why it stopped, one of STOPS ('more': it needs more bytes; any other gives the\n"
     "stream back). Out of memory raises MemoryError."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef relay_module = {
    PyModuleDef_HEAD_INIT, .m_name = "prefixpin.core._relay", .m_size = -1, .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__relay(void) {
    if (PyType_Ready(&RelayType) < 0) return NULL;
    PyObject *m = PyModule_Create(&relay_module);
    if (m == NULL) return NULL;
    Py_INCREF(&RelayType);
    if (PyModule_AddObject(m, "Relay", (PyObject *)&RelayType) < 0) {
        Py_DECREF(&RelayType);
        Py_DECREF(m);
        return NULL;
    }
    PyObject *stops = PyTuple_New(SCAN_STOPS);
    for (Py_ssize_t i = 0; stops != NULL && i < SCAN_STOPS; i++) {
        PyObject *name = PyUnicode_FromString(scan_stops[i]);
        if (name == NULL) Py_CLEAR(stops);
        else PyTuple_SET_ITEM(stops, i, name);
    }
    if (stops == NULL || PyModule_AddObject(m, "STOPS", stops) < 0) {
        Py_XDECREF(stops);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "MAX_PENDING", MAX_PENDING) < 0 ||
        PyModule_AddIntConstant(m, "MAX_SIZE_LINE", MAX_SIZE_LINE) < 0 ||
        PyModule_AddIntConstant(m, "MAX_RELAYED_HELD", MAX_RELAYED_HELD) < 0 ||
        PyModule_AddIntConstant(m, "MAX_READ_PER_RUN", MAX_READ_PER_RUN) < 0 ||
        PyModule_AddIntConstant(m, "MIN_READ_PER_RUN", MIN_READ_PER_RUN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
