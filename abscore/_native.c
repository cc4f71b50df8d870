/* abscore._native: the per-element loops of the hot paths, over buffers.
 *
 * Optional: every function here has a numpy or Python twin that defines its
 * result (abscore/native.py says which is which), and the project runs without
 * this module where it could not be compiled. Each function takes 1-d contiguous
 * buffers (numpy arrays, pyarrow buffers), checks their item sizes and bounds,
 * and writes into the output buffers it is given; none keeps a reference (the
 * ValueHandle type holds its handle's fields, as the Python handle does).
 *
 * - bytes_hashes: the key-group rule of binary values,
 *   fmix64(crc32(value) << 32 | length)  (abscore.hashing._hash_short_bytes);
 * - key_codes: the int64 code of each string key of the columnar store's index
 *   (abs.state.varkeys.key_codes);
 * - index_lookup / index_insert / index_fill: the open-addressing table of
 *   abs.state.keyindex.IntKeyIndex (packed 12-byte rows of (key, int32 slot), slot -1 empty, linear
 *   probing without wrap-around, homes from a multiplicative hash scaled to the table);
 * - partition: a key_by writer's rows grouped by channel (abs.runtime.exchange);
 * - text_array: a list of str or bytes keys as Arrow string/binary buffers (abs.columns);
 * - RestoredIndex (text_index, int_index): the key index of a restored key group over its
 *   Arrow text keys or int64 keys (abs.state.restored), which ValueHandle probes;
 * - byte_streams: a values image's numeric column byte-stream split and joined again
 *   (storage.values_images);
 * - ValueHandle: value() and update() of a typed ValueState's handle (abs.state.handles).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* CRC-32/ISO-HDLC (zlib's), slicing by 8: crc_t[k][b] is the CRC step of byte b followed by k
 * zero bytes, so 8 bytes take 8 independent lookups instead of a chain of 8. */
static uint32_t crc_t[8][256];

static void init_crc_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
        crc_t[0][i] = c;
    }
    for (int k = 1; k < 8; k++)
        for (int i = 0; i < 256; i++)
            crc_t[k][i] = (crc_t[k - 1][i] >> 8) ^ crc_t[0][crc_t[k - 1][i] & 0xFF];
}

static inline uint32_t crc32_of(const uint8_t *p, int64_t len) {
    uint32_t c = 0xFFFFFFFFu;
    while (len >= 8) {
        uint32_t one, two;
        memcpy(&one, p, 4);
        memcpy(&two, p + 4, 4);
        one ^= c;
        c = crc_t[7][one & 0xFF] ^ crc_t[6][(one >> 8) & 0xFF] ^ crc_t[5][(one >> 16) & 0xFF] ^ crc_t[4][one >> 24] ^
            crc_t[3][two & 0xFF] ^ crc_t[2][(two >> 8) & 0xFF] ^ crc_t[1][(two >> 16) & 0xFF] ^ crc_t[0][two >> 24];
        p += 8;
        len -= 8;
    }
    if (len >= 4) {
        uint32_t one;
        memcpy(&one, p, 4);
        one ^= c;
        c = crc_t[3][one & 0xFF] ^ crc_t[2][(one >> 8) & 0xFF] ^ crc_t[1][(one >> 16) & 0xFF] ^ crc_t[0][one >> 24];
        p += 4;
        len -= 4;
    }
    while (len-- > 0)
        c = crc_t[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static inline uint64_t fmix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ull;
    x ^= x >> 33;
    return x;
}

/* ------------------------------------------------------------------ buffers */

typedef struct {
    Py_buffer view;
    int held;
} Buf;

static void release(Buf *b) {
    if (b->held) {
        PyBuffer_Release(&b->view);
        b->held = 0;
    }
}

/* A contiguous buffer of items of one of the sizes in `sizes` (0-terminated). */
static int get_buf(PyObject *obj, Buf *b, int writable, const int *sizes, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0) {
        /* pyarrow buffers export bytes without a format */
        PyErr_Clear();
        if (PyObject_GetBuffer(obj, &b->view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
            PyErr_Format(PyExc_TypeError, "%s: not a contiguous%s buffer", what, writable ? " writable" : "");
            return -1;
        }
    }
    b->held = 1;
    for (const int *s = sizes; *s; s++)
        if (b->view.itemsize == *s)
            return 0;
    PyErr_Format(PyExc_TypeError, "%s: items of %zd bytes, which this function does not take", what,
                 b->view.itemsize);
    release(b);
    return -1;
}

/* Release up to four buffers (NULL for none). */
static void release_all(Buf *a, Buf *b, Buf *c, Buf *d) {
    Buf *all[] = {a, b, c, d};
    for (int i = 0; i < 4; i++)
        if (all[i])
            release(all[i]);
}

static inline Py_ssize_t items(const Buf *b) { return b->view.len / b->view.itemsize; }

static inline int64_t offset_at(const Buf *off, Py_ssize_t i) {
    return off->view.itemsize == 4 ? (int64_t)((const int32_t *)off->view.buf)[i]
                                   : ((const int64_t *)off->view.buf)[i];
}

/* Offsets (n + 1 of them, int32 or int64) that rise and stay within `data`. */
static int check_offsets(const Buf *off, Py_ssize_t data_len) {
    Py_ssize_t n1 = items(off);
    if (n1 < 1) {
        PyErr_SetString(PyExc_ValueError, "offsets: at least one offset is needed");
        return -1;
    }
    int64_t prev = offset_at(off, 0);
    if (prev < 0) {
        PyErr_SetString(PyExc_ValueError, "offsets: a negative offset");
        return -1;
    }
    for (Py_ssize_t i = 1; i < n1; i++) {
        int64_t o = offset_at(off, i);
        if (o < prev) {
            PyErr_Format(PyExc_ValueError, "offsets: offset %zd (%lld) is below the one before", i, (long long)o);
            return -1;
        }
        prev = o;
    }
    if (prev > data_len) {
        PyErr_Format(PyExc_ValueError, "offsets: the last offset (%lld) is past the data (%zd bytes)",
                     (long long)prev, data_len);
        return -1;
    }
    return 0;
}

static const int SIZES_OFFSETS[] = {4, 8, 0};
static const int SIZES_BYTE[] = {1, 0};
static const int SIZES_8[] = {8, 0};

/* The GIL stays held over a batch's loop (releasing it for ~50 us would let another thread keep
 * it for a switch interval, 5 ms); a restore's millions of keys let the other threads run. */
static inline PyThreadState *release_for(Py_ssize_t n) { return n > 65536 ? PyEval_SaveThread() : NULL; }

static inline void restore_after(PyThreadState *ts) {
    if (ts)
        PyEval_RestoreThread(ts);
}

/* The arguments (offsets, data, out) of a function of each value of a binary array. */
typedef struct {
    Buf off, data, out;
    Py_ssize_t n;
} Values;

static void values_close(Values *v) {
    release(&v->off);
    release(&v->data);
    release(&v->out);
}

static int values_open(PyObject *args, Values *v) {
    PyObject *o_off, *o_data, *o_out;
    memset(v, 0, sizeof *v);
    if (!PyArg_ParseTuple(args, "OOO", &o_off, &o_data, &o_out))
        return -1;
    if (get_buf(o_off, &v->off, 0, SIZES_OFFSETS, "offsets") < 0 || get_buf(o_data, &v->data, 0, SIZES_BYTE, "data") < 0 ||
        get_buf(o_out, &v->out, 1, SIZES_8, "out") < 0 || check_offsets(&v->off, v->data.view.len) < 0) {
        values_close(v);
        return -1;
    }
    v->n = items(&v->off) - 1;
    if (items(&v->out) < v->n) {
        PyErr_SetString(PyExc_ValueError, "out: shorter than the values");
        values_close(v);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ hashing */

static PyObject *bytes_hashes(PyObject *self, PyObject *args) {
    Values v;
    if (values_open(args, &v) < 0)
        return NULL;
    const uint8_t *d = v.data.view.buf;
    uint64_t *h = v.out.view.buf;
    PyThreadState *ts = release_for(v.n);
    int64_t lo = offset_at(&v.off, 0);
    for (Py_ssize_t i = 0; i < v.n; i++) {
        int64_t hi = offset_at(&v.off, i + 1);
        uint32_t c = crc32_of(d + lo, hi - lo);
        h[i] = fmix64(((uint64_t)c << 32) | (uint64_t)(uint32_t)(hi - lo));
        lo = hi;
    }
    restore_after(ts);
    values_close(&v);
    Py_RETURN_NONE;
}

#define M1 0x9E3779B97F4A7C15ull
#define M2 0xBF58476D1CE4E5B9ull
#define M3 0x94D049BB133111EBull

/* The little-endian word of the len (>= 0) bytes at p, the rest zero; end: the end of the buffer
 * (a whole word is read where one fits before it, and masked). */
static inline uint64_t word_at(const uint8_t *p, int64_t len, const uint8_t *end) {
    uint64_t w = 0;
    if (end - p >= 8) {
        memcpy(&w, p, 8);
        if (len < 8)
            w &= len ? (~0ull >> (64 - 8 * len)) : 0;
    } else {
        memcpy(&w, p, (size_t)(len < 8 ? len : 8));
    }
    return w; /* on a little-endian machine; the module refuses others at import */
}

static PyObject *key_codes(PyObject *self, PyObject *args) {
    Values v;
    if (values_open(args, &v) < 0)
        return NULL;
    const uint8_t *d = v.data.view.buf, *end = d + v.data.view.len;
    uint64_t *codes = v.out.view.buf;
    Py_ssize_t hashed = 0, n = v.n;
    PyThreadState *ts = release_for(n);
    int64_t lo = offset_at(&v.off, 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t hi = offset_at(&v.off, i + 1);
        int64_t len = hi - lo;
        const uint8_t *p = d + lo;
        uint64_t first = word_at(p, len, end);
        if (len <= 7) {
            codes[i] = first | ((uint64_t)len << 56);
        } else {
            uint64_t h = ((uint64_t)len + M1) * M2;
            h ^= first;
            h *= M3;
            h ^= h >> 32;
            for (int64_t j = 8; j < len; j += 8) {
                uint64_t m = h ^ word_at(p + j, len - j, end);
                m *= M2;
                m ^= m >> 29;
                h = m;
            }
            h ^= h >> 31;
            h *= M3;
            h ^= h >> 32;
            codes[i] = h | (1ull << 63);
            hashed++;
        }
        lo = hi;
    }
    restore_after(ts);
    values_close(&v);
    return PyLong_FromSsize_t(hashed);
}

/* ------------------------------------------------------------------ the index */

#define H1 0x9E3779B97F4A7C15ull
#define H2 0xBF58476D1CE4E5B9ull
#define AHEAD 8 /* keys whose home row is prefetched ahead of the probe */

/* The home row of a key among `homes` (1..2**32): the top 32 bits of a multiplicative hash
 * scaled to [0, homes) ("fast range"), so a table needs no power-of-two size. */
static inline int64_t home_of(int64_t key, uint64_t homes) {
    uint64_t x = (uint64_t)key * H1;
    x ^= x >> 31;
    x *= H2;
    return (int64_t)(((x >> 32) * homes) >> 32);
}

/* A row: the key (8 bytes) and its slot (int32, -1: empty), packed in 12 bytes, read and
 * written with memcpy (a row is 4-byte aligned at best). */
#define ROW 12
#define MAX_SLOT 0x7FFFFFFFll

typedef struct {
    char *t; /* rows of (key, slot) */
    int64_t rows;
    uint64_t homes;
} Table;

static inline int32_t row_slot(const char *t, int64_t pos) {
    int32_t s;
    memcpy(&s, t + ROW * pos + 8, 4);
    return s;
}

static inline int64_t row_key(const char *t, int64_t pos) {
    int64_t k;
    memcpy(&k, t + ROW * pos, 8);
    return k;
}

static inline void row_set(char *t, int64_t pos, int64_t key, int64_t slot) {
    int32_t s = (int32_t)slot;
    memcpy(t + ROW * pos, &key, 8);
    memcpy(t + ROW * pos + 8, &s, 4);
}

static int get_table(PyObject *o_t, long long homes, Buf *b, Table *tab) {
    if (get_buf(o_t, b, 1, SIZES_BYTE, "table") < 0)
        return -1;
    if (b->view.len % ROW) {
        PyErr_SetString(PyExc_ValueError, "table: not a whole number of 12-byte rows (an 8-byte key and a 4-byte slot)");
        release(b);
        return -1;
    }
    if (homes < 1 || homes > (1LL << 32)) {
        PyErr_SetString(PyExc_ValueError, "homes: must be 1..2**32");
        release(b);
        return -1;
    }
    tab->t = b->view.buf;
    tab->rows = b->view.len / ROW;
    tab->homes = (uint64_t)homes;
    if ((int64_t)tab->homes > tab->rows) {
        PyErr_SetString(PyExc_ValueError, "table: fewer rows than home positions");
        release(b);
        return -1;
    }
    return 0;
}

static int need(const Buf *b, Py_ssize_t n, const char *what) {
    if (items(b) < n) {
        PyErr_Format(PyExc_ValueError, "%s: shorter than the keys", what);
        return -1;
    }
    return 0;
}

/* The table, the keys and two writable outputs at least as long as the keys (b[0..3]). */
static int index_open(PyObject *o_t, long long homes, PyObject *o_keys, PyObject *o_a, const char *a, PyObject *o_b,
                      const char *bn, Buf b[4], Table *tab, Py_ssize_t *n) {
    if (get_table(o_t, homes, &b[0], tab) < 0 || get_buf(o_keys, &b[1], 0, SIZES_8, "keys") < 0 ||
        get_buf(o_a, &b[2], 1, SIZES_8, a) < 0 || get_buf(o_b, &b[3], 1, SIZES_8, bn) < 0)
        goto fail;
    *n = items(&b[1]);
    if (need(&b[2], *n, a) < 0 || need(&b[3], *n, bn) < 0)
        goto fail;
    return 0;
fail:
    release_all(&b[0], &b[1], &b[2], &b[3]);
    return -1;
}

/* index_lookup(table, homes, keys, slots, ends): slot of every key (-1 absent) and the row where
 * its probe ended (for an absent key the first empty row, or the row count past the end). */
static PyObject *index_lookup(PyObject *self, PyObject *args) {
    PyObject *o_t, *o_keys, *o_slots, *o_ends;
    long long n_homes;
    if (!PyArg_ParseTuple(args, "OLOOO", &o_t, &n_homes, &o_keys, &o_slots, &o_ends))
        return NULL;
    Buf b[4];
    memset(b, 0, sizeof b);
    Table tab;
    Py_ssize_t n;
    if (index_open(o_t, n_homes, o_keys, o_slots, "slots", o_ends, "ends", b, &tab, &n) < 0)
        return NULL;
    const int64_t *k = b[1].view.buf;
    int64_t *s = b[2].view.buf, *e = b[3].view.buf;
    const char *t = tab.t;
    int64_t rows = tab.rows;
    PyThreadState *ts = release_for(n);
    int64_t homes[AHEAD];
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++) {
        homes[i] = home_of(k[i], tab.homes);
        __builtin_prefetch(t + ROW * homes[i]);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t pos = homes[i % AHEAD];
        if (i + AHEAD < n) {
            int64_t h = home_of(k[i + AHEAD], tab.homes);
            homes[i % AHEAD] = h;
            __builtin_prefetch(t + ROW * h);
        }
        int64_t key = k[i], slot = -1;
        for (; pos < rows; pos++) {
            int32_t v = row_slot(t, pos);
            if (v < 0)
                break;
            if (row_key(t, pos) == key) {
                slot = v;
                break;
            }
        }
        s[i] = slot;
        e[i] = pos;
    }
    restore_after(ts);
    release_all(&b[0], &b[1], &b[2], &b[3]);
    Py_RETURN_NONE;
}

/* index_insert(table, homes, keys, slots, start): put distinct absent keys at the first empty row
 * from start (their probe ends; -1: from their home). False when one would land past the end (the
 * table is then partly filled: the caller rebuilds it). */
static PyObject *index_insert(PyObject *self, PyObject *args) {
    PyObject *o_t, *o_keys, *o_slots, *o_start;
    long long n_homes;
    if (!PyArg_ParseTuple(args, "OLOOO", &o_t, &n_homes, &o_keys, &o_slots, &o_start))
        return NULL;
    Buf bt = {0}, keys = {0}, slots = {0}, start = {0};
    Table tab;
    PyObject *result = NULL;
    int have_start = o_start != Py_None;
    if (get_table(o_t, n_homes, &bt, &tab) < 0 || get_buf(o_keys, &keys, 0, SIZES_8, "keys") < 0 ||
        get_buf(o_slots, &slots, 0, SIZES_8, "slots") < 0 ||
        (have_start && get_buf(o_start, &start, 0, SIZES_8, "start") < 0))
        goto done;
    Py_ssize_t n = items(&keys);
    if (need(&slots, n, "slots") < 0 || (have_start && need(&start, n, "start") < 0))
        goto done;
    const int64_t *k = keys.view.buf, *sl = slots.view.buf, *st = have_start ? start.view.buf : NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (sl[i] < 0 || sl[i] > MAX_SLOT) {
            PyErr_Format(PyExc_ValueError, "slots: %lld is not a slot a key index holds (0..2**31 - 1; a subtask's key index holds at most 2**31 keys: run "
                         "the job at a higher parallelism)", (long long)sl[i]);
            goto done;
        }
    char *t = tab.t;
    int64_t rows = tab.rows;
    int ok = 1;
    PyThreadState *ts = release_for(n);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t pos = (st && st[i] >= 0) ? st[i] : home_of(k[i], tab.homes);
        while (pos < rows && row_slot(t, pos) >= 0)
            pos++;
        if (pos >= rows) {
            ok = 0;
            break;
        }
        row_set(t, pos, k[i], sl[i]);
    }
    restore_after(ts);
    result = PyBool_FromLong(ok);
done:
    release_all(&bt, &keys, &slots, &start);
    return result;
}

/* index_fill(table, homes, keys, first, rows_out, owners_out): fill an empty table with
 * keys[i] -> first + i, keys in order; a key already there (the same key at an earlier row) is
 * not placed: its row goes to rows_out and the row that holds it to owners_out. Returns the
 * number of such rows, or -1 when a key would land past the end (the caller retries with a
 * longer table). */
static PyObject *index_fill(PyObject *self, PyObject *args) {
    PyObject *o_t, *o_keys, *o_rows, *o_owners;
    long long n_homes, first;
    if (!PyArg_ParseTuple(args, "OLOLOO", &o_t, &n_homes, &o_keys, &first, &o_rows, &o_owners))
        return NULL;
    Buf b[4];
    memset(b, 0, sizeof b);
    Table tab;
    Py_ssize_t n;
    if (index_open(o_t, n_homes, o_keys, o_rows, "rows", o_owners, "owners", b, &tab, &n) < 0)
        return NULL;
    const int64_t *k = b[1].view.buf;
    int64_t *ro = b[2].view.buf, *ow = b[3].view.buf;
    char *t = tab.t;
    int64_t rows = tab.rows;
    if (first < 0 || first + (int64_t)n - 1 > MAX_SLOT) {
        PyErr_Format(PyExc_ValueError, "first: slots %lld.. of %zd keys are not slots a key index holds (0..2**31 - 1; a subtask's key index "
                     "holds at most 2**31 keys: run the job at a higher parallelism)",
                     first, n);
        release_all(&b[0], &b[1], &b[2], &b[3]);
        return NULL;
    }
    Py_ssize_t dups = 0;
    int ok = 1;
    PyThreadState *ts = release_for(n);
    int64_t homes[AHEAD];
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++) {
        homes[i] = home_of(k[i], tab.homes);
        __builtin_prefetch(t + ROW * homes[i], 1);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t pos = homes[i % AHEAD];
        if (i + AHEAD < n) {
            int64_t h = home_of(k[i + AHEAD], tab.homes);
            homes[i % AHEAD] = h;
            __builtin_prefetch(t + ROW * h, 1);
        }
        int64_t key = k[i];
        for (; pos < rows; pos++) {
            int32_t v = row_slot(t, pos);
            if (v < 0) {
                row_set(t, pos, key, first + i);
                break;
            }
            if (row_key(t, pos) == key) {
                ro[dups] = i;
                ow[dups] = v - first;
                dups++;
                break;
            }
        }
        if (pos >= rows) {
            ok = 0;
            break;
        }
    }
    restore_after(ts);
    release_all(&b[0], &b[1], &b[2], &b[3]);
    return PyLong_FromSsize_t(ok ? dups : -1);
}

/* ------------------------------------------------------------------ byte streams */

#if defined(__SSE2__)
/* One step of the 16-value block transposes: registers i and i + 4 interleaved byte by byte
 * (low halves, then high halves). Four steps take 16 eight-byte values (two a register) to
 * their 8 byte planes (16 bytes each, plane b in register b); three take the planes back. */
static inline void interleave8(__m128i r[8]) {
    __m128i t[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm_unpacklo_epi8(r[i], r[i + 4]);
        t[2 * i + 1] = _mm_unpackhi_epi8(r[i], r[i + 4]);
    }
    memcpy(r, t, sizeof t);
}
#endif

/* byte_streams(src, out, width, split): n = len(src) / width values of `width` bytes;
 * split: out[b * n + i] = src[i * width + b] (byte b of every value, then byte b + 1, ...;
 * Parquet's BYTE_STREAM_SPLIT); else the inverse, out[i * width + b] = src[b * n + i]. */
static PyObject *byte_streams(PyObject *self, PyObject *args) {
    PyObject *o_src, *o_out;
    int width, split;
    if (!PyArg_ParseTuple(args, "OOip", &o_src, &o_out, &width, &split))
        return NULL;
    if (width < 1 || width > 64) {
        PyErr_SetString(PyExc_ValueError, "width: must be 1..64 bytes");
        return NULL;
    }
    Buf src, out;
    memset(&src, 0, sizeof src);
    memset(&out, 0, sizeof out);
    if (get_buf(o_src, &src, 0, SIZES_BYTE, "src") < 0)
        return NULL;
    if (get_buf(o_out, &out, 1, SIZES_BYTE, "out") < 0) {
        release(&src);
        return NULL;
    }
    Py_ssize_t len = src.view.len;
    if (len % width || out.view.len != len) {
        PyErr_Format(PyExc_ValueError, "src: %zd bytes, out: %zd; both must be the same whole number of %d-byte values",
                     len, out.view.len, width);
        release(&src);
        release(&out);
        return NULL;
    }
    const uint8_t *s = src.view.buf;
    uint8_t *d = out.view.buf;
    Py_ssize_t n = len / width, i = 0;
    PyThreadState *ts = release_for(len / 8);
#if defined(__SSE2__)
    if (width == 8) {
        __m128i r[8];
        for (; i + 16 <= n; i += 16) {
            if (split) {
                for (int k = 0; k < 8; k++)
                    r[k] = _mm_loadu_si128((const __m128i *)(s + 8 * i + 16 * k));
                for (int step = 0; step < 4; step++)
                    interleave8(r);
                for (int b = 0; b < 8; b++)
                    _mm_storeu_si128((__m128i *)(d + b * n + i), r[b]);
            } else {
                for (int b = 0; b < 8; b++)
                    r[b] = _mm_loadu_si128((const __m128i *)(s + b * n + i));
                for (int step = 0; step < 3; step++)
                    interleave8(r);
                for (int k = 0; k < 8; k++)
                    _mm_storeu_si128((__m128i *)(d + 8 * i + 16 * k), r[k]);
            }
        }
    }
#endif
    for (; i < n; i++)
        for (int b = 0; b < width; b++) {
            if (split)
                d[b * n + i] = s[i * width + b];
            else
                d[i * width + b] = s[b * n + i];
        }
    restore_after(ts);
    release(&src);
    release(&out);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ text keys */

static const int SIZES_INT32[] = {4, 0};

/* text_array(keys, offsets) -> (is_bytes, data) or None: the keys of a list that are all
 * exactly str (UTF-8) or all exactly bytes, one after the other in `data`, with offsets[i] the
 * start of key i (int32, n + 1 of them). None when this function does not decide: an empty
 * list, keys of other or mixed types, a str that does not encode (lone surrogates), or over
 * 2 GiB of bytes; abs.columns._text_array (pyarrow) then decides. */
static PyObject *text_array(PyObject *self, PyObject *args) {
    PyObject *keys, *o_off;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &keys, &o_off))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    Buf off = {0};
    if (get_buf(o_off, &off, 1, SIZES_INT32, "offsets") < 0)
        return NULL;
    if (items(&off) != n + 1) {
        Py_ssize_t got = items(&off);
        release(&off);
        PyErr_Format(PyExc_ValueError, "offsets: %zd items for %zd keys (n + 1 needed)", got, n);
        return NULL;
    }
    if (n == 0) {
        release(&off);
        Py_RETURN_NONE;
    }
    int32_t *o = (int32_t *)off.view.buf;
    int is_bytes = PyBytes_CheckExact(PyList_GET_ITEM(keys, 0));
    Py_ssize_t cap = n * 8 + 64, total = 0;
    PyObject *data = PyBytes_FromStringAndSize(NULL, cap);
    if (!data) {
        release(&off);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyList_GET_SIZE(keys) != n)
            goto undecided; /* changed under us (a finalizer run by an allocation) */
        PyObject *k = PyList_GET_ITEM(keys, i);
        const char *p;
        Py_ssize_t len;
        if (is_bytes) {
            if (!PyBytes_CheckExact(k))
                goto undecided;
            p = PyBytes_AS_STRING(k);
            len = PyBytes_GET_SIZE(k);
        } else {
            if (!PyUnicode_CheckExact(k))
                goto undecided;
            p = PyUnicode_AsUTF8AndSize(k, &len);
            if (!p) {
                if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError))
                    goto fail;
                PyErr_Clear();
                goto undecided;
            }
        }
        if (len > INT32_MAX - total)
            goto undecided;
        if (total + len > cap) {
            cap = cap * 2 > total + len ? cap * 2 : total + len;
            if (cap > INT32_MAX)
                cap = INT32_MAX;
            if (_PyBytes_Resize(&data, cap) < 0) {
                release(&off);
                return NULL; /* data was freed */
            }
        }
        o[i] = (int32_t)total;
        memcpy(PyBytes_AS_STRING(data) + total, p, len);
        total += len;
    }
    o[n] = (int32_t)total;
    release(&off);
    if (_PyBytes_Resize(&data, total) < 0)
        return NULL;
    return Py_BuildValue("(NN)", PyBool_FromLong(is_bytes), data);
undecided:
    Py_DECREF(data);
    release(&off);
    Py_RETURN_NONE;
fail:
    Py_DECREF(data);
    release(&off);
    return NULL;
}

/* ------------------------------------------------------------------ routing */

/* partition(key_groups, routing, order, counts): channel c = routing[key_groups[i]] of every row,
 * counts[c] rows per channel, and order: the rows grouped by channel, in their order within
 * each (a stable counting sort). key_groups int32, routing int16, order and counts int64
 * (counts as long as there are channels). */
static const int SIZES_4[] = {4, 0};
static const int SIZES_2[] = {2, 0};

static PyObject *partition(PyObject *self, PyObject *args) {
    PyObject *o_kg, *o_routing, *o_order, *o_counts;
    if (!PyArg_ParseTuple(args, "OOOO", &o_kg, &o_routing, &o_order, &o_counts))
        return NULL;
    Buf kg = {0}, routing = {0}, order = {0}, counts = {0};
    PyObject *result = NULL;
    int64_t *start = NULL;
    if (get_buf(o_kg, &kg, 0, SIZES_4, "key_groups") < 0 || get_buf(o_routing, &routing, 0, SIZES_2, "routing") < 0 ||
        get_buf(o_order, &order, 1, SIZES_8, "order") < 0 || get_buf(o_counts, &counts, 1, SIZES_8, "counts") < 0)
        goto done;
    Py_ssize_t n = items(&kg), groups = items(&routing), channels = items(&counts);
    if (need(&order, n, "order") < 0)
        goto done;
    const int32_t *g = kg.view.buf;
    const int16_t *r = routing.view.buf;
    int64_t *c = counts.view.buf, *o = order.view.buf;
    memset(c, 0, (size_t)channels * sizeof(int64_t));
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t k = g[i];
        if (k < 0 || k >= groups || r[k] < 0 || r[k] >= channels) {
            PyErr_Format(PyExc_ValueError, "row %zd: key group %d routes to no channel of %zd (routing has %zd key groups)",
                         i, (int)k, channels, groups);
            goto done;
        }
        c[r[k]]++;
    }
    start = PyMem_Malloc((size_t)(channels ? channels : 1) * sizeof(int64_t));
    if (!start) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t at = 0;
    for (Py_ssize_t ch = 0; ch < channels; ch++) {
        start[ch] = at;
        at += c[ch];
    }
    for (Py_ssize_t i = 0; i < n; i++)
        o[start[r[g[i]]]++] = i;
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(start);
    release_all(&kg, &routing, &order, &counts);
    return result;
}

/* ------------------------------------------------------------------ the restored key index */

/* RestoredIndex: the key -> slot index of a restored key group (abs.state.restored) over the
 * arrays it was restored into, without a Python object per key: the Arrow buffers of str (or
 * bytes) keys, or the int64 numpy array of integer keys. Open addressing with linear probing
 * over a power-of-two table of entries, each (a tag: the top bits of the key's hash) << shift
 * | (slot + 1), 0 empty; a hit compares the key itself. The entries are 32 bits wide when the
 * slots need at most 24 of them (the tag keeps the other 8 or more: one false tag match in
 * 256 or fewer at worst), else 64 (32 bits of tag): half the fresh memory a restored key
 * group's first use takes in the usual case, and half the cache lines its lookups touch. A probe takes an exact str (its UTF-8
 * bytes), bytes or int, as the index's keys are; find() answers -2 for any other kind of key
 * (a bool, a float, a subclass: the caller builds the key group's Python index and asks it,
 * which knows what such a key equals). Keys appended since the restore (add()) are kept in a
 * dict, looked up after the table.
 *
 * A delete marks its key's slot dead (kill()) instead of building the key group: a bit per
 * slot, restored or added, in a bitmap made on the first kill (none before: a key group nobody
 * deletes from pays one pointer test on a found key, nothing else). find() answers -1 for a
 * dead slot's key and add() takes it again as a new slot; the slots never move, len() counts
 * the dead ones too (`killed` of them), and a capture or a build leaves them out
 * (dead_bits()). */

enum { KEYS_STR, KEYS_BYTES, KEYS_INT };

typedef struct {
    PyObject_HEAD
    PyObject *keys;   /* the array the buffers belong to (kept alive, given back as .keys) */
    PyObject *extra, *extra_keys; /* keys added since the restore: key -> slot, and in slot order */
    PyObject *values; /* the restored values (numpy) until the key group copies them, or NULL */
    Py_buffer off, data, vals;
    int has_off, has_data, has_vals, kind;
    char vcode;       /* the values' array typecode */
    const int32_t *o; /* text: n + 1 offsets, from the array's own offset */
    const char *d;    /* text: the data; int: the int64 keys */
    Py_ssize_t n;
    void *table;      /* uint32_t entries, or uint64_t when wide */
    uint64_t mask;    /* the table's size - 1 */
    uint64_t slots;   /* the entry's low `shift` bits: slot + 1 */
    int shift, tagshift, wide; /* an entry's tag is the hash >> tagshift, << shift */
    uint8_t *dead;    /* bit s & 7 of byte s >> 3: slot s was deleted (kill()); NULL until the first */
    Py_ssize_t dead_cap, killed; /* the slots the bitmap covers (those past it are live); how many are dead */
} RestoredIndex;

static inline uint64_t ti_entry(const RestoredIndex *t, uint64_t at) {
    return t->wide ? ((const uint64_t *)t->table)[at] : ((const uint32_t *)t->table)[at];
}

/* the tag of hash h, where an entry holds it */
static inline uint64_t ti_tag(const RestoredIndex *t, uint64_t h) { return h >> t->tagshift << t->shift; }

static PyTypeObject RestoredIndexType;

/* slot s (>= 0) was deleted; call only where t->dead is set */
static inline int ti_is_dead(const RestoredIndex *t, Py_ssize_t s) {
    return s < t->dead_cap && (t->dead[s >> 3] >> (s & 7) & 1);
}

/* the hash of a text key in the index: not the bytes' key-group hash (abscore.hashing, the
 * crc32 rule above), whose bits every key of one key group shares (see int_hash) */
static inline uint64_t text_hash(const char *p, Py_ssize_t len) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)len;
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
        p += 8;
        len -= 8;
    }
    if (len) {
        uint64_t w = 0;
        memcpy(&w, p, (size_t)len);
        h = (h ^ w) * 0xC4CEB9FE1A85EC53ull;
    }
    return fmix64(h);
}

/* the hash of an int64 key in the index: not fmix64(k) itself, which is the key's key-group
 * hash (abscore.hashing): every key of one key group shares bits of it, and would crowd into
 * a few stretches of the table */
static inline uint64_t int_hash(int64_t k) { return fmix64((uint64_t)k * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull); }

/* slot of the int64 key k, or -1 */
static inline Py_ssize_t ti_lookup_int(const RestoredIndex *t, int64_t k) {
    const int64_t *keys = (const int64_t *)t->d;
    uint64_t h = int_hash(k), tag = ti_tag(t, h), at = h & t->mask;
    for (;;) {
        uint64_t e = ti_entry(t, at);
        if (!e)
            return -1;
        if ((e & ~t->slots) == tag && keys[(e & t->slots) - 1] == k)
            return (Py_ssize_t)(e & t->slots) - 1;
        at = (at + 1) & t->mask;
    }
}

/* slot of the len bytes at p, or -1 */
static inline Py_ssize_t ti_lookup(const RestoredIndex *t, const char *p, Py_ssize_t len) {
    uint64_t h = text_hash(p, len), tag = ti_tag(t, h), at = h & t->mask;
    for (;;) {
        uint64_t e = ti_entry(t, at);
        if (!e)
            return -1;
        if ((e & ~t->slots) == tag) {
            Py_ssize_t slot = (Py_ssize_t)(e & t->slots) - 1;
            int32_t a = t->o[slot], b = t->o[slot + 1];
            if (b - a == len && memcmp(t->d + a, p, (size_t)len) == 0)
                return slot;
        }
        at = (at + 1) & t->mask;
    }
}

/* the bytes a probe of `key` compares (text kinds), or NULL with *kind_ok: 1 the key is of the
 * index's kind but has no such bytes (lone surrogates), 0 it is of another kind (*other: -1 a
 * kind never equal to the index's keys, -2 a kind only the dict can answer for) */
static const char *ti_bytes(const RestoredIndex *t, PyObject *key, Py_ssize_t *len, int *other) {
    if (PyUnicode_CheckExact(key)) {
        if (t->kind != KEYS_STR) {
            *other = t->kind == KEYS_BYTES ? -1 : -2; /* a str never equals bytes; an int index: ask */
            return NULL;
        }
        if (PyUnicode_IS_COMPACT_ASCII(key)) {
            *len = PyUnicode_GET_LENGTH(key);
            return (const char *)PyUnicode_DATA(key);
        }
        const char *p = PyUnicode_AsUTF8AndSize(key, len);
        if (!p) {
            PyErr_Clear(); /* lone surrogates: no Arrow string holds them */
            *other = -1;
        }
        return p;
    }
    if (PyBytes_CheckExact(key) && t->kind == KEYS_BYTES) {
        *len = PyBytes_GET_SIZE(key);
        return PyBytes_AS_STRING(key);
    }
    *other = PyBytes_CheckExact(key) && t->kind == KEYS_STR ? -1 : -2;
    return NULL;
}

/* slot of key, -1 absent (or its slot dead), -2 a key this index cannot answer for; never
 * raises. The keys added since the restore (add()) are looked up in `extra` after the table,
 * and after a dead restored slot too: a key deleted and written again is an added key. */
static Py_ssize_t ti_find(const RestoredIndex *t, PyObject *key) {
    Py_ssize_t slot;
    if (t->kind == KEYS_INT) {
        if (!PyLong_CheckExact(key))
            return -2;
        int overflow = 0;
        long long k = PyLong_AsLongLongAndOverflow(key, &overflow);
        if (overflow)
            return -1; /* outside int64: no key here equals it (add() takes none) */
        slot = ti_lookup_int(t, (int64_t)k);
    } else {
        Py_ssize_t len;
        int other = 0;
        const char *p = ti_bytes(t, key, &len, &other);
        if (!p)
            return other;
        slot = ti_lookup(t, p, len);
    }
    if (slot >= 0 && !(t->dead && ti_is_dead(t, slot)))
        return slot;
    if (!t->extra)
        return -1;
    PyObject *at = PyDict_GetItemWithError(t->extra, key); /* borrowed; str, bytes and int: no error */
    if (!at) {
        PyErr_Clear();
        return -1;
    }
    slot = PyLong_AsSsize_t(at); /* the key's last slot: any before it is dead */
    return t->dead && ti_is_dead(t, slot) ? -1 : slot;
}

static void ti_drop_vals(RestoredIndex *t) {
    if (t->has_vals) {
        t->has_vals = 0;
        PyBuffer_Release(&t->vals);
    }
    Py_CLEAR(t->values);
}

static void ti_dealloc(RestoredIndex *t) {
    PyObject_GC_UnTrack(t);
    ti_drop_vals(t);
    Py_CLEAR(t->keys);
    Py_CLEAR(t->extra);
    Py_CLEAR(t->extra_keys);
    if (t->has_data)
        PyBuffer_Release(&t->data);
    if (t->has_off)
        PyBuffer_Release(&t->off);
    PyMem_Free(t->table);
    PyMem_Free(t->dead);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int ti_traverse(RestoredIndex *t, visitproc visit, void *arg) {
    Py_VISIT(t->keys);
    Py_VISIT(t->values);
    Py_VISIT(t->extra);
    Py_VISIT(t->extra_keys);
    return 0;
}

/* the slots: the restored keys' and the added keys', dead ones included */
static Py_ssize_t ti_len(RestoredIndex *t) { return t->n + (t->extra_keys ? PyList_GET_SIZE(t->extra_keys) : 0); }

static PyObject *ti_find_py(RestoredIndex *t, PyObject *key) { return PyLong_FromSsize_t(ti_find(t, key)); }

/* add(key) -> True: key (absent, see find(): a key whose slot is dead too) is the next slot,
 * len(index) before the call; False: a key this index does not take (another kind, an int
 * outside int64, a str without UTF-8), the caller builds the key group's dict */
static PyObject *ti_add(RestoredIndex *t, PyObject *key) {
    if (t->kind == KEYS_INT) {
        if (!PyLong_CheckExact(key))
            Py_RETURN_FALSE;
        int overflow = 0;
        PyLong_AsLongLongAndOverflow(key, &overflow);
        if (overflow)
            Py_RETURN_FALSE;
    } else {
        Py_ssize_t len;
        int other = 0;
        if (!ti_bytes(t, key, &len, &other))
            Py_RETURN_FALSE;
    }
    if (ti_find(t, key) != -1) {
        PyErr_Format(PyExc_KeyError, "RestoredIndex.add: %R is there already", key);
        return NULL;
    }
    if (!t->extra) {
        t->extra = PyDict_New();
        t->extra_keys = PyList_New(0);
        if (!t->extra || !t->extra_keys) {
            Py_CLEAR(t->extra);
            Py_CLEAR(t->extra_keys);
            return NULL;
        }
    }
    Py_ssize_t at = ti_len(t);
    if (t->dead && at < t->dead_cap)
        t->dead[at >> 3] &= (uint8_t)~(1u << (at & 7)); /* a new slot is live */
    PyObject *slot = PyLong_FromSsize_t(at);
    if (!slot)
        return NULL;
    if (PyList_Append(t->extra_keys, key) < 0) {
        Py_DECREF(slot);
        return NULL;
    }
    int bad = PyDict_SetItem(t->extra, key, slot);
    Py_DECREF(slot);
    if (bad < 0) {
        PyList_SetSlice(t->extra_keys, PyList_GET_SIZE(t->extra_keys) - 1, PyList_GET_SIZE(t->extra_keys), NULL);
        return NULL;
    }
    Py_RETURN_TRUE;
}

static PyObject *ti_base(RestoredIndex *t, void *unused) { return PyLong_FromSsize_t(t->n); }

/* kill(slot) -> True: slot (0 <= slot < len(index)) is dead now, find() no longer answers it;
 * False: it was dead already. The bitmap is made on the first kill, over every slot there is
 * then, and grows (at least doubling) for an added slot past it. */
static PyObject *ti_kill(RestoredIndex *t, PyObject *arg) {
    Py_ssize_t s = PyLong_AsSsize_t(arg);
    if (s == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t len = ti_len(t);
    if (s < 0 || s >= len) {
        PyErr_Format(PyExc_IndexError, "RestoredIndex.kill: slot %zd of %zd", s, len);
        return NULL;
    }
    if (s >= t->dead_cap) {
        Py_ssize_t cap = len > 2 * t->dead_cap ? len : 2 * t->dead_cap, was = (t->dead_cap + 7) >> 3;
        size_t bytes = (size_t)((cap + 7) >> 3);
        uint8_t *dead = PyMem_Realloc(t->dead, bytes ? bytes : 1);
        if (!dead)
            return PyErr_NoMemory();
        memset(dead + was, 0, bytes - (size_t)was);
        t->dead = dead;
        t->dead_cap = (Py_ssize_t)bytes * 8;
    }
    if (ti_is_dead(t, s))
        Py_RETURN_FALSE;
    t->dead[s >> 3] |= (uint8_t)(1u << (s & 7));
    t->killed++;
    Py_RETURN_TRUE;
}

/* dead_bits() -> the dead slots as bytes, bit s & 7 of byte s >> 3 for slot s (numpy's
 * unpackbits(..., bitorder="little")), (len(index) + 7) // 8 of them; None while none is dead */
static PyObject *ti_dead_bits(RestoredIndex *t, PyObject *unused) {
    if (!t->killed)
        Py_RETURN_NONE;
    Py_ssize_t bytes = (ti_len(t) + 7) >> 3, have = t->dead_cap >> 3;
    PyObject *out = PyBytes_FromStringAndSize(NULL, bytes);
    if (!out)
        return NULL;
    char *p = PyBytes_AS_STRING(out);
    Py_ssize_t copy = have < bytes ? have : bytes;
    memcpy(p, t->dead, (size_t)copy);
    memset(p + copy, 0, (size_t)(bytes - copy));
    return out;
}

/* the item size of an array typecode the restored values may have, 0 for another */
static int vcode_size(char c) {
    switch (c) {
    case 'b': case 'B': return 1;
    case 'h': case 'H': return 2;
    case 'i': case 'I': return 4;
    case 'q': case 'Q': case 'd': return 8;
    }
    return 0;
}

/* keep_values(values, typecode): read value() of the restored slots from `values` (a
 * C-contiguous buffer of at least len(keys) items of that array typecode, read-only will do)
 * until drop_values(): the key group copies them into its own array on its first write */
static PyObject *ti_keep_values(RestoredIndex *t, PyObject *args) {
    PyObject *values;
    const char *code;
    if (!PyArg_ParseTuple(args, "Os", &values, &code))
        return NULL;
    int size = strlen(code) == 1 ? vcode_size(code[0]) : 0;
    if (!size) {
        PyErr_Format(PyExc_ValueError, "keep_values: typecode %s is none of bhiqBHIQd", code);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(values, &view, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (view.len < (Py_ssize_t)size * t->n || (view.itemsize != size && view.itemsize != 1)) {
        PyErr_Format(PyExc_ValueError, "keep_values: %zd bytes of items of %zd bytes hold no %zd values of typecode %s",
                     view.len, view.itemsize, t->n, code);
        PyBuffer_Release(&view);
        return NULL;
    }
    ti_drop_vals(t);
    t->vals = view;
    t->has_vals = 1;
    t->vcode = code[0];
    Py_INCREF(values);
    t->values = values;
    Py_RETURN_NONE;
}

static PyObject *ti_drop_values(RestoredIndex *t, PyObject *unused) {
    ti_drop_vals(t);
    Py_RETURN_NONE;
}

/* the kept restored value of slot i (0 <= i < n), as the array of its typecode gives it */
static PyObject *ti_kept_value(const RestoredIndex *t, Py_ssize_t i) {
    const char *p = (const char *)t->vals.buf;
    switch (t->vcode) {
    case 'b': return PyLong_FromLong(((const int8_t *)p)[i]);
    case 'B': return PyLong_FromLong(((const uint8_t *)p)[i]);
    case 'h': return PyLong_FromLong(((const int16_t *)p)[i]);
    case 'H': return PyLong_FromLong(((const uint16_t *)p)[i]);
    case 'i': return PyLong_FromLong(((const int32_t *)p)[i]);
    case 'I': return PyLong_FromUnsignedLong(((const uint32_t *)p)[i]);
    case 'q': return PyLong_FromLongLong(((const int64_t *)p)[i]);
    case 'Q': return PyLong_FromUnsignedLongLong(((const uint64_t *)p)[i]);
    default: return PyFloat_FromDouble(((const double *)p)[i]);
    }
}

static PyMethodDef ti_methods[] = {
    {"find", (PyCFunction)ti_find_py, METH_O, "find(key) -> its slot, -1 when absent (or deleted), -2 for a key of another kind than the index's"},
    {"add", (PyCFunction)ti_add, METH_O, "add(key) -> True: the absent key is slot len(index) now; False: a key this index does not take"},
    {"keep_values", (PyCFunction)ti_keep_values, METH_VARARGS,
     "keep_values(values, typecode): value() reads the restored slots from these until drop_values()"},
    {"drop_values", (PyCFunction)ti_drop_values, METH_NOARGS, "forget the kept values (the key group copied them)"},
    {"kill", (PyCFunction)ti_kill, METH_O, "kill(slot) -> True: the slot is dead now (its key deleted); False: it was"},
    {"dead_bits", (PyCFunction)ti_dead_bits, METH_NOARGS,
     "dead_bits() -> bytes, bit s & 7 of byte s >> 3 set for a dead slot s; None while no slot is dead"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef ti_members[] = {
    {"keys", T_OBJECT_EX, offsetof(RestoredIndex, keys), READONLY, "the array of the restored keys (Arrow; int64 numpy)"},
    {"extra_keys", T_OBJECT, offsetof(RestoredIndex, extra_keys), READONLY, "the keys added since, in slot order (a list), or None"},
    {"kept_values", T_OBJECT, offsetof(RestoredIndex, values), READONLY, "the restored values keep_values() took, or None"},
    {"kept_typecode", T_CHAR, offsetof(RestoredIndex, vcode), READONLY, "their array typecode (as keep_values() took it)"},
    {"killed", T_PYSSIZET, offsetof(RestoredIndex, killed), READONLY, "how many of the len(index) slots are dead (kill())"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef ti_getset[] = {
    {"base", (getter)ti_base, NULL, "the number of restored keys (slots 0 .. base - 1)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods ti_as_sequence = {.sq_length = (lenfunc)ti_len};

static PyTypeObject RestoredIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "abscore._native.RestoredIndex",
    .tp_basicsize = sizeof(RestoredIndex),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The key -> slot index of a restored key group (see abscore/_native.c); make one with text_index() or int_index().",
    .tp_traverse = (traverseproc)ti_traverse,
    .tp_dealloc = (destructor)ti_dealloc,
    .tp_methods = ti_methods,
    .tp_members = ti_members,
    .tp_getset = ti_getset,
    .tp_as_sequence = &ti_as_sequence,
};

static RestoredIndex *ti_new(PyObject *keys, Py_ssize_t n, int kind) {
    RestoredIndex *t = PyObject_GC_New(RestoredIndex, &RestoredIndexType);
    if (!t)
        return NULL;
    Py_INCREF(keys);
    t->keys = keys;
    t->extra = t->extra_keys = NULL;
    t->o = NULL;
    t->d = "";
    t->has_off = t->has_data = t->has_vals = 0;
    t->values = NULL;
    t->vcode = 0;
    t->table = NULL;
    t->dead = NULL;
    t->dead_cap = t->killed = 0;
    t->n = n;
    t->kind = kind;
    return t;
}

/* the table for n keys, all zero: a load of 3/8 to 3/4, linear probing stays short and the
 * table small (4 bytes an entry while n < 2**24, else 8; see RestoredIndex) */
static int narrow_bits = 24, least_bits = 1; /* see index_layout() */

static int ti_alloc_table(RestoredIndex *t) {
    uint64_t cap = 8;
    while (cap < (uint64_t)t->n + (uint64_t)t->n / 3)
        cap <<= 1;
    int bits = least_bits; /* the slot + 1 of n keys: 1 .. n */
    while (((uint64_t)1 << bits) <= (uint64_t)t->n)
        bits++;
    t->wide = bits > narrow_bits;
    t->shift = t->wide ? 32 : bits;
    t->tagshift = t->wide ? 32 : 32 + bits; /* the tag: the hash's top 32 - bits bits (32 when wide) */
    t->slots = ((uint64_t)1 << t->shift) - 1;
    t->table = PyMem_Calloc((size_t)cap, t->wide ? sizeof(uint64_t) : sizeof(uint32_t));
    if (!t->table) {
        PyErr_NoMemory();
        return -1;
    }
    t->mask = cap - 1;
    return 0;
}

/* insert row i of hash h; 1 when an equal key is there already */
static inline int ti_insert(RestoredIndex *t, Py_ssize_t i, uint64_t h) {
    uint64_t tag = ti_tag(t, h), at = h & t->mask;
    for (;;) {
        uint64_t e = ti_entry(t, at);
        if (!e) {
            if (t->wide)
                ((uint64_t *)t->table)[at] = tag | (uint64_t)(i + 1);
            else
                ((uint32_t *)t->table)[at] = (uint32_t)(tag | (uint64_t)(i + 1));
            return 0;
        }
        if ((e & ~t->slots) == tag) {
            Py_ssize_t slot = (Py_ssize_t)(e & t->slots) - 1;
            if (t->kind == KEYS_INT) {
                if (((const int64_t *)t->d)[slot] == ((const int64_t *)t->d)[i])
                    return 1;
            } else if (t->o[slot + 1] - t->o[slot] == t->o[i + 1] - t->o[i] &&
                       memcmp(t->d + t->o[slot], t->d + t->o[i], (size_t)(t->o[i + 1] - t->o[i])) == 0)
                return 1;
        }
        at = (at + 1) & t->mask;
    }
}

/* every row into the table, a batch's hashes first (their entries fetched while the next are
 * hashed), without the GIL for a large one (nothing here touches a Python object); the
 * index, or None when a key repeats (the caller inserts key by key) */
static PyObject *ti_fill(RestoredIndex *t) {
    int repeated = 0;
    Py_ssize_t n = t->n;
    PyThreadState *ts = release_for(n);
    uint64_t hashes[16];
    for (Py_ssize_t i = 0; i < n && !repeated; i++) {
        if (!(i & 15)) {
            for (Py_ssize_t j = i; j < i + 16 && j < n; j++) {
                hashes[j - i] = t->kind == KEYS_INT ? int_hash(((const int64_t *)t->d)[j])
                                                    : text_hash(t->d + t->o[j], t->o[j + 1] - t->o[j]);
#if defined(__GNUC__)
                __builtin_prefetch(t->wide ? (void *)&((uint64_t *)t->table)[hashes[j - i] & t->mask]
                                           : (void *)&((uint32_t *)t->table)[hashes[j - i] & t->mask], 1);
#endif
            }
        }
        repeated = ti_insert(t, i, hashes[i & 15]);
    }
    if (ts)
        PyEval_RestoreThread(ts);
    if (repeated) {
        Py_DECREF(t);
        Py_RETURN_NONE;
    }
    return (PyObject *)t;
}

/* text_index(keys, offsets, data, start, n, is_bytes): the index of the n keys of an Arrow
 * string (binary) array whose int32 offsets buffer is `offsets` (read from item `start`, the
 * array's offset) and data buffer `data` (None: every key empty), or None when a key repeats. */
static PyObject *text_index(PyObject *self, PyObject *args) {
    PyObject *keys, *o_off, *o_data;
    Py_ssize_t start, n;
    int is_bytes;
    if (!PyArg_ParseTuple(args, "OOOnnp", &keys, &o_off, &o_data, &start, &n, &is_bytes))
        return NULL;
    if (n < 0 || start < 0 || n >= 0x7FFFFFFF) {
        PyErr_Format(PyExc_ValueError, "text_index: %zd keys from item %zd (0 to 2**31 - 2 keys)", n, start);
        return NULL;
    }
    RestoredIndex *t = ti_new(keys, n, is_bytes ? KEYS_BYTES : KEYS_STR);
    if (!t)
        return NULL;
    if (PyObject_GetBuffer(o_off, &t->off, PyBUF_C_CONTIGUOUS) < 0)
        goto fail;
    t->has_off = 1;
    t->o = (const int32_t *)t->off.buf + start;
    if ((start + n + 1) * (Py_ssize_t)sizeof(int32_t) > t->off.len) {
        PyErr_Format(PyExc_ValueError, "text_index: offsets of %zd bytes hold no %zd items from item %zd", t->off.len,
                     n + 1, start);
        goto fail;
    }
    Py_ssize_t dlen = 0;
    if (o_data != Py_None) {
        if (PyObject_GetBuffer(o_data, &t->data, PyBUF_C_CONTIGUOUS) < 0)
            goto fail;
        t->has_data = 1;
        t->d = (const char *)t->data.buf;
        dlen = t->data.len;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (t->o[i] < 0 || t->o[i] > t->o[i + 1] || t->o[i + 1] > dlen) {
            PyErr_Format(PyExc_ValueError, "text_index: offset %zd out of order or past the data's %zd bytes", i, dlen);
            goto fail;
        }
    if (ti_alloc_table(t) < 0)
        goto fail;
    PyObject_GC_Track(t);
    return ti_fill(t);
fail:
    Py_DECREF(t);
    return NULL;
}

/* index_layout(narrow_bits, least_bits) -> the previous pair: the indexes made from now on
 * take 32-bit entries while their slots need at most narrow_bits bits (24; 0: never; 31: a
 * tag of 1 bit at least) and give the slots at least least_bits bits (1; 30 with narrow_bits
 * 31: a tag of 2 bits, most probes a tag match).
 * For tests, which reach the 64-bit entries and tag collisions with a few keys this way. */
static PyObject *index_layout(PyObject *self, PyObject *args) {
    int narrow, least;
    if (!PyArg_ParseTuple(args, "ii", &narrow, &least))
        return NULL;
    if (narrow < 0 || narrow > 31 || least < 1 || least > 31) {
        PyErr_Format(PyExc_ValueError, "index_layout(%d, %d): narrow_bits 0 .. 31, least_bits 1 .. 31", narrow, least);
        return NULL;
    }
    PyObject *was = Py_BuildValue("ii", narrow_bits, least_bits);
    if (was) {
        narrow_bits = narrow;
        least_bits = least;
    }
    return was;
}

/* int_index(keys): the index of a 1-d contiguous int64 array of keys (kept, given back as
 * .keys), or None when a key repeats. */
static PyObject *int_index(PyObject *self, PyObject *args) {
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "O", &keys))
        return NULL;
    Buf b = {0};
    if (get_buf(keys, &b, 0, SIZES_8, "keys") < 0)
        return NULL;
    if (b.view.format && strcmp(b.view.format, "q") && strcmp(b.view.format, "l") && strcmp(b.view.format, "<q") &&
        strcmp(b.view.format, "<l")) {
        PyErr_Format(PyExc_TypeError, "int_index: keys of format %s (int64 needed)", b.view.format);
        release(&b);
        return NULL;
    }
    Py_ssize_t n = items(&b);
    if (n >= 0x7FFFFFFF) {
        release(&b);
        PyErr_Format(PyExc_ValueError, "int_index: %zd keys (at most 2**31 - 2)", n);
        return NULL;
    }
    RestoredIndex *t = ti_new(keys, n, KEYS_INT);
    if (!t) {
        release(&b);
        return NULL;
    }
    t->data = b.view; /* the view is the index's now: released with it */
    t->has_data = 1;
    t->d = (const char *)t->data.buf;
    if (ti_alloc_table(t) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    PyObject_GC_Track(t);
    return ti_fill(t);
}

/* ------------------------------------------------------------------ the value handle */

/* ValueHandle: the base of abs.state.handles.ColumnValueStateHandle, its value() and update() in C.
 *
 * The Python class defines everything else, and the two methods' Python versions as
 * _value_slow() and _update_by_lookup(value): whenever the fast path meets anything it does not
 * expect (another backend or column class, an unset slot, nulls in the column, a key group out of
 * range, an unhashable key, a value the column refuses), it calls those, which give the same
 * result or name the error, having changed nothing first. The fast path reads the backend's
 * current_key / current_kg / epoch and the column's index / values / stamps / nulls straight from
 * their __slots__, at offsets taken from the classes by configure_value_handles() and used only
 * for objects of exactly those classes. */

typedef struct {
    PyObject_HEAD
    PyObject *backend, *data, *dirty, *deleted, *name;
    PyObject *hit_key, *hit_col;
    Py_ssize_t hit_slot;
    int hit_probed; /* hit_col was a probed key group: its slot holds only while it stays one */
} ValueHandle;

static PyTypeObject *vh_backend_type, *vh_column_type, *vh_restored_type;
static Py_ssize_t off_key = -1, off_kg, off_epoch, off_index, off_values, off_stamps, off_nulls, off_image;
static PyObject *str_value_slow, *str_update_by_lookup, *str_probe;

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

static int vh_traverse(ValueHandle *self, visitproc visit, void *arg) {
    Py_VISIT(self->backend);
    Py_VISIT(self->data);
    Py_VISIT(self->dirty);
    Py_VISIT(self->deleted);
    Py_VISIT(self->name);
    Py_VISIT(self->hit_key);
    Py_VISIT(self->hit_col);
    return 0;
}

static int vh_clear(ValueHandle *self) {
    Py_CLEAR(self->backend);
    Py_CLEAR(self->data);
    Py_CLEAR(self->dirty);
    Py_CLEAR(self->deleted);
    Py_CLEAR(self->name);
    Py_CLEAR(self->hit_key);
    Py_CLEAR(self->hit_col);
    return 0;
}

static void vh_dealloc(ValueHandle *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    vh_clear(self);
    tp->tp_free((PyObject *)self);
}

static PyObject *vh_slow_value(ValueHandle *self) {
    if (self->hit_probed) { /* the Python path may build that key group; what it remembers is in a built one */
        Py_CLEAR(self->hit_col);
        self->hit_probed = 0;
    }
    return PyObject_CallMethodNoArgs((PyObject *)self, str_value_slow);
}

static PyObject *vh_value(ValueHandle *self, PyObject *unused);

/* where value() found the current key, for the update() of a read-modify-write; probed: in a
 * probed key group, whose build renumbers the slots when it had deletes (the handle is not
 * told, so update() writes there only while the column is still of the class it was) */
static inline void vh_remember(ValueHandle *self, PyObject *key, PyObject *col, Py_ssize_t slot, int probed) {
    Py_INCREF(key);
    Py_XSETREF(self->hit_key, key);
    Py_INCREF(col);
    Py_XSETREF(self->hit_col, col);
    self->hit_slot = slot;
    self->hit_probed = probed;
}

/* value() of a key group restored and not built yet (abs.state.restored.RestoredColumn): its
 * index answers (the first time, col._probe() makes it), the nulls are its own, the values its
 * own once a write copied them (before: the restored ones the index kept), the stamps made by
 * that write; anything else goes the Python way (which builds the key group) */
static PyObject *vh_restored_value(ValueHandle *self, PyObject *col, PyObject *key) {
    PyObject *image = SLOT(col, off_image), *result = NULL;
    if (!image || Py_TYPE(image) != &RestoredIndexType) {
        /* held across the call: it runs Python (and the index's build lets other threads run) */
        Py_INCREF(col);
        PyObject *ok = PyObject_CallMethodNoArgs(col, str_probe);
        int yes = ok == Py_True;
        Py_XDECREF(ok);
        image = SLOT(col, off_image);
        int probed = ok && yes && Py_TYPE(col) == vh_restored_type && image && Py_TYPE(image) == &RestoredIndexType;
        Py_DECREF(col);
        if (!ok)
            return NULL;
        if (!probed)
            return vh_slow_value(self);
        /* the current key may have changed while other threads ran: start again */
        return vh_value(self, NULL);
    }
    PyObject *values = SLOT(col, off_values), *nulls = SLOT(col, off_nulls);
    RestoredIndex *index = (RestoredIndex *)image;
    /* no values of its own yet: the restored ones the index kept (copied on the first write) */
    if ((!values && !index->has_vals) || !nulls || !PySet_CheckExact(nulls) || PySet_GET_SIZE(nulls))
        return vh_slow_value(self);
    Py_ssize_t slot = ti_find(index, key);
    if (slot == -2)
        return vh_slow_value(self);
    if (slot == -1)
        Py_RETURN_NONE;
    if (values)
        result = PySequence_GetItem(values, slot);
    else if (slot < index->n)
        result = ti_kept_value(index, slot);
    else
        return vh_slow_value(self); /* an added key: its value is in the copy */
    if (!result) {
        PyErr_Clear();
        return vh_slow_value(self);
    }
    vh_remember(self, key, col, slot, 1);
    return result;
}

static PyObject *vh_value(ValueHandle *self, PyObject *unused) {
    PyObject *b = self->backend, *data = self->data;
    if (off_key < 0 || !b || Py_TYPE(b) != vh_backend_type || !data || !PyList_CheckExact(data))
        return vh_slow_value(self);
    PyObject *key = SLOT(b, off_key), *kgo = SLOT(b, off_kg);
    if (!key || !kgo || !PyLong_CheckExact(kgo))
        return vh_slow_value(self);
    Py_ssize_t kg = PyLong_AsSsize_t(kgo);
    if (kg < 0 || kg >= PyList_GET_SIZE(data)) {
        PyErr_Clear();
        return vh_slow_value(self);
    }
    PyObject *col = PyList_GET_ITEM(data, kg);
    if (Py_TYPE(col) == vh_restored_type)
        return vh_restored_value(self, col, key);
    if (Py_TYPE(col) != vh_column_type)
        return vh_slow_value(self);
    PyObject *index = SLOT(col, off_index), *nulls = SLOT(col, off_nulls);
    if (!index || !PyDict_CheckExact(index) || !nulls || !PySet_CheckExact(nulls) || PySet_GET_SIZE(nulls))
        return vh_slow_value(self);
    Py_INCREF(key);
    Py_INCREF(col);
    Py_INCREF(index);
    PyObject *result = NULL;
    PyObject *i = PyDict_GetItemWithError(index, key); /* borrowed; may run a key's __eq__ */
    if (!i) {
        if (PyErr_Occurred()) {
            PyErr_Clear(); /* an unhashable key: the Python path names it */
            result = vh_slow_value(self);
        } else {
            result = Py_None;
            Py_INCREF(result);
        }
        goto out;
    }
    Py_INCREF(i);
    PyObject *values = SLOT(col, off_values);
    nulls = SLOT(col, off_nulls); /* a key's __eq__ may have changed the column */
    Py_ssize_t slot = PyLong_AsSsize_t(i);
    Py_DECREF(i);
    if (!values || slot < 0 || !nulls || !PySet_CheckExact(nulls) || PySet_GET_SIZE(nulls)) {
        PyErr_Clear();
        result = vh_slow_value(self);
        goto out;
    }
    result = PySequence_GetItem(values, slot);
    if (!result) {
        PyErr_Clear();
        result = vh_slow_value(self);
        goto out;
    }
    vh_remember(self, key, col, slot, 0);
out:
    Py_DECREF(index);
    Py_DECREF(col);
    Py_DECREF(key);
    return result;
}

static PyObject *vh_update(ValueHandle *self, PyObject *value) {
    PyObject *b = self->backend, *col = self->hit_col;
    if (off_key >= 0 && b && Py_TYPE(b) == vh_backend_type && col &&
        Py_TYPE(col) == (self->hit_probed ? vh_restored_type : vh_column_type)) {
        PyObject *key = SLOT(b, off_key), *epoch = SLOT(b, off_epoch);
        PyObject *nulls = SLOT(col, off_nulls), *values = SLOT(col, off_values), *stamps = SLOT(col, off_stamps);
        if (key && key == self->hit_key && epoch && nulls && PySet_CheckExact(nulls) && !PySet_GET_SIZE(nulls) &&
            values && stamps) {
            Py_INCREF(values);
            Py_INCREF(stamps);
            Py_INCREF(epoch);
            int bad = PySequence_SetItem(values, self->hit_slot, value);
            if (bad < 0) {
                /* a value the column refuses (TypeError, OverflowError): nothing changed, the
                 * Python path names the problem; anything else is raised as the Python update does */
                if (PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_OverflowError))
                    PyErr_Clear();
                else {
                    Py_DECREF(values);
                    Py_DECREF(stamps);
                    Py_DECREF(epoch);
                    return NULL;
                }
            } else {
                int err = PySequence_SetItem(stamps, self->hit_slot, epoch);
                Py_DECREF(values);
                Py_DECREF(stamps);
                Py_DECREF(epoch);
                if (err < 0)
                    return NULL;
                Py_RETURN_NONE;
            }
            Py_DECREF(values);
            Py_DECREF(stamps);
            Py_DECREF(epoch);
        }
    }
    return PyObject_CallMethodOneArg((PyObject *)self, str_update_by_lookup, value);
}

static PyMethodDef vh_methods[] = {
    {"value", (PyCFunction)vh_value, METH_NOARGS, "The value of the current key, or None if it has none."},
    {"update", (PyCFunction)vh_update, METH_O, "Set the value of the current key (None is stored as a value; use clear())."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef vh_members[] = {
    {"_backend", T_OBJECT_EX, offsetof(ValueHandle, backend), 0, NULL},
    {"_data", T_OBJECT_EX, offsetof(ValueHandle, data), 0, NULL},
    {"_dirty", T_OBJECT_EX, offsetof(ValueHandle, dirty), 0, NULL},
    {"_deleted", T_OBJECT_EX, offsetof(ValueHandle, deleted), 0, NULL},
    {"name", T_OBJECT_EX, offsetof(ValueHandle, name), 0, NULL},
    {"_hit_key", T_OBJECT_EX, offsetof(ValueHandle, hit_key), 0, NULL},
    {"_hit_col", T_OBJECT_EX, offsetof(ValueHandle, hit_col), 0, NULL},
    {"_hit_slot", T_PYSSIZET, offsetof(ValueHandle, hit_slot), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ValueHandleType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "abscore._native.ValueHandle",
    .tp_basicsize = sizeof(ValueHandle),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The C value() and update() of abs.state.handles.ColumnValueStateHandle (see abscore/_native.c).",
    .tp_traverse = (traverseproc)vh_traverse,
    .tp_clear = (inquiry)vh_clear,
    .tp_dealloc = (destructor)vh_dealloc,
    .tp_methods = vh_methods,
    .tp_members = vh_members,
    .tp_new = PyType_GenericNew,
};

/* The offset of slot `name` of class `cls` (a __slots__ member), or -1 with an error set. */
static Py_ssize_t slot_offset(PyObject *cls, const char *name) {
    PyObject *d = PyObject_GetAttrString(cls, name);
    if (!d)
        return -1;
    Py_ssize_t off = -1;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type) && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX)
        off = ((PyMemberDescrObject *)d)->d_member->offset;
    else
        PyErr_Format(PyExc_TypeError, "configure_value_handles: %R.%s is not a __slots__ member", cls, name);
    Py_DECREF(d);
    return off;
}

static PyObject *configure_value_handles(PyObject *self, PyObject *args) {
    PyObject *bcls, *ccls, *rcls;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyType_Type, &bcls, &PyType_Type, &ccls, &PyType_Type, &rcls))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)rcls, (PyTypeObject *)ccls) ||
        ((PyTypeObject *)rcls)->tp_basicsize != ((PyTypeObject *)ccls)->tp_basicsize) {
        PyErr_Format(PyExc_TypeError, "configure_value_handles: %R is not a subclass of %R with its slots alone", rcls, ccls);
        return NULL;
    }
    Py_ssize_t k = slot_offset(bcls, "current_key"), g = slot_offset(bcls, "current_kg"), e = slot_offset(bcls, "epoch"),
               ix = slot_offset(ccls, "index"), v = slot_offset(ccls, "values"), st = slot_offset(ccls, "stamps"),
               nu = slot_offset(ccls, "nulls"), im = slot_offset(ccls, "image");
    if (k < 0 || g < 0 || e < 0 || ix < 0 || v < 0 || st < 0 || nu < 0 || im < 0)
        return NULL;
    Py_INCREF(rcls);
    Py_XSETREF(vh_restored_type, (PyTypeObject *)rcls);
    off_image = im;
    Py_INCREF(bcls);
    Py_XSETREF(vh_backend_type, (PyTypeObject *)bcls);
    Py_INCREF(ccls);
    Py_XSETREF(vh_column_type, (PyTypeObject *)ccls);
    off_kg = g;
    off_epoch = e;
    off_index = ix;
    off_values = v;
    off_stamps = st;
    off_nulls = nu;
    off_key = k; /* last: a handle takes the fast path once this is set */
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bytes_hashes", bytes_hashes, METH_VARARGS,
     "bytes_hashes(offsets, data, out): out[i] = fmix64(crc32(value i) << 32 | length of value i)"},
    {"key_codes", key_codes, METH_VARARGS,
     "key_codes(offsets, data, out) -> the number of keys whose code is a hash (longer than 7 bytes)"},
    {"index_lookup", index_lookup, METH_VARARGS, "index_lookup(table, homes, keys, slots, ends)"},
    {"index_insert", index_insert, METH_VARARGS, "index_insert(table, homes, keys, slots, start) -> bool"},
    {"index_fill", index_fill, METH_VARARGS,
     "index_fill(table, homes, keys, first, rows, owners) -> duplicate rows, or -1: the table is too short"},
    {"configure_value_handles", configure_value_handles, METH_VARARGS,
     "configure_value_handles(backend_class, column_class, restored_column_class): the classes whose __slots__ ValueHandle reads"},
    {"byte_streams", byte_streams, METH_VARARGS,
     "byte_streams(src, out, width, split): fixed-width values to their byte planes (split) or back"},
    {"text_array", text_array, METH_VARARGS,
     "text_array(keys, offsets) -> (is_bytes, data), or None where abs.columns._text_array decides"},
    {"text_index", text_index, METH_VARARGS,
     "text_index(keys, offsets, data, start, n, is_bytes) -> RestoredIndex, or None when a key repeats"},
    {"index_layout", index_layout, METH_VARARGS,
     "index_layout(narrow_bits, least_bits) -> the previous pair (tests: 64-bit entries and short tags with few keys)"},
    {"int_index", int_index, METH_VARARGS, "int_index(keys) -> RestoredIndex of int64 keys, or None when a key repeats"},
    {"partition", partition, METH_VARARGS,
     "partition(key_groups, routing, order, counts): rows grouped by channel routing[key group], stably"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "abscore._native",
                                    "The per-element loops of the hot paths (see abscore.native).", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    const uint16_t one = 1;
    if (*(const uint8_t *)&one != 1) {
        PyErr_SetString(PyExc_ImportError, "abscore._native: little-endian machines only");
        return NULL;
    }
    init_crc_table();
    str_value_slow = PyUnicode_InternFromString("_value_slow");
    str_update_by_lookup = PyUnicode_InternFromString("_update_by_lookup");
    str_probe = PyUnicode_InternFromString("_probe");
    if (!str_value_slow || !str_update_by_lookup || !str_probe || PyType_Ready(&ValueHandleType) < 0 ||
        PyType_Ready(&RestoredIndexType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&ValueHandleType);
    if (PyModule_AddObject(m, "ValueHandle", (PyObject *)&ValueHandleType) < 0) {
        Py_DECREF(&ValueHandleType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&RestoredIndexType);
    if (PyModule_AddObject(m, "RestoredIndex", (PyObject *)&RestoredIndexType) < 0) {
        Py_DECREF(&RestoredIndexType);
        Py_DECREF(m);
        return NULL;
    }
    /* what the functions' arguments mean (abscore.native.API): 2 = the index takes its number
     * of home positions, not a shift; 3 = configure_value_handles takes the restored column's
     * class too (and the module has RestoredIndex); 4 = the index's rows are 12 bytes, (key, int32 slot),
     * and its table is given as bytes */
    if (PyModule_AddIntConstant(m, "API", 4) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
