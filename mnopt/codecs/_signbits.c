/* Sign-compression loops (mnopt/codecs/sign.py): signs into packed bits
 * with the error-feedback residual, packed bits back into +-scale, and the
 * counting ring's bit-plane counts.
 *
 * numpy needs several passes and temporaries for each of these (a byte per
 * element, fancy indexing, unpackbits); these are one pass each.  Results
 * are bit-identical to sign.py's numpy code: the same splitmix64 coin, the
 * same float32 arithmetic, bits big-endian within a byte (numpy's
 * packbits).
 *
 * All functions take contiguous buffers (anything with the buffer
 * protocol) and release the GIL.  Bit positions are element indices into
 * the whole packed buffer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Eight count bytes are handled as one little-endian 64-bit word: byte k
 * of the word is element k.  (Big-endian machines take the plain loops.) */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define WORDS 1
#else
#define WORDS 0
#endif
#define LSB8 0x0101010101010101ull
/* (word & LSB8) * GATHER >> 56: byte k's low bit lands on bit 7 - k. */
#define GATHER 0x8040201008040201ull

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* SPREAD[b]: byte k = bit 7 - k of b (a packed byte, unpacked). */
static uint64_t SPREAD[256];

static void init_spread(void)
{
    for (int b = 0; b < 256; b++) {
        uint64_t w = 0;
        for (int k = 0; k < 8; k++)
            w |= (uint64_t)((b >> (7 - k)) & 1) << (8 * k);
        SPREAD[b] = w;
    }
}

static inline uint64_t load64(const uint8_t *p)
{
    uint64_t w; memcpy(&w, p, 8); return w;
}

static inline void store64(uint8_t *p, uint64_t w) { memcpy(p, &w, 8); }

/* The coin of sign.coin: top bit of splitmix64(index + golden * (step+1)). */
static inline unsigned coin(uint64_t index, uint64_t salt)
{
    uint64_t z = index + salt;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z = z ^ (z >> 31);
    return (unsigned)(z >> 63);
}

static inline uint64_t coin_salt(long long step)
{
    return 0x9E3779B97F4A7C15ull * (uint64_t)(step + 1);
}

static inline void put_bit(uint8_t *bits, Py_ssize_t i, unsigned bit)
{
    uint8_t mask = (uint8_t)(0x80u >> (i & 7));
    bits[i >> 3] = (uint8_t)((bits[i >> 3] & ~mask) | (bit ? mask : 0));
}

static inline unsigned get_bit(const uint8_t *bits, Py_ssize_t i)
{
    return (bits[i >> 3] >> (7 - (i & 7))) & 1u;
}

static int check(Py_buffer *b, Py_ssize_t need, const char *what)
{
    if (b->len < need) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, need %zd", what,
                     b->len, need);
        return -1;
    }
    return 0;
}

/* Bits of elements first..first+n-1 must lie inside the buffer. */
static int check_bits(Py_buffer *bits, Py_ssize_t first, Py_ssize_t n)
{
    if (first < 0) {
        PyErr_SetString(PyExc_ValueError, "first must be >= 0");
        return -1;
    }
    return check(bits, (first + n + 7) / 8, "bits");
}

/* One element of encode, for the ends and where SSE2 is missing. */
static inline void encode_one(const float *pv, float *rv, uint8_t *bv,
                              Py_ssize_t j, Py_ssize_t first, uint64_t salt,
                              const float both[2])
{
    unsigned bit = pv[j] > 0.0f
        || (pv[j] == 0.0f && coin((uint64_t)(first + j), salt));
    put_bit(bv, first + j, bit);
    if (rv) rv[j] = pv[j] - both[bit];
}

/* encode(p f32[n], scale, bits, first, step, residual f32[n] or None):
 * bit of element first+j = p[j] > 0 (p[j] == 0: the coin);
 * residual[j] = p[j] - (bit ? scale : -scale). */
static PyObject *py_encode(PyObject *m, PyObject *args)
{
    Py_buffer p, bits, res = {0};
    PyObject *res_obj;
    double scale_d;
    Py_ssize_t first;
    long long step;
    if (!PyArg_ParseTuple(args, "y*dw*nLO", &p, &scale_d, &bits, &first,
                          &step, &res_obj))
        return NULL;
    Py_ssize_t n = p.len / 4;
    int ok = check_bits(&bits, first, n) == 0;
    if (ok && res_obj != Py_None) {
        ok = PyObject_GetBuffer(res_obj, &res, PyBUF_WRITABLE) == 0
             && check(&res, p.len, "residual") == 0;
    }
    if (ok) {
        const float *pv = (const float *)p.buf;
        float *rv = (float *)res.buf;  /* NULL without error feedback */
        uint8_t *bv = (uint8_t *)bits.buf;
        const float s = (float)scale_d, both[2] = {-s, s};
        const uint64_t salt = coin_salt(step);
        Py_BEGIN_ALLOW_THREADS
        Py_ssize_t j = 0;
        /* Up to a byte boundary, then 8 elements per byte. */
        for (; j < n && ((first + j) & 7); j++)
            encode_one(pv, rv, bv, j, first, salt, both);
#if defined(__SSE2__)
        /* Branch-free (signs are random: a branch on them mispredicts half
         * the time), four floats per compare; movemask puts element k on
         * bit k, REVERSED4 turns that into packbits' order.  Zeros (rare)
         * are mended after. */
        static const uint8_t REVERSED4[16] = {0, 8, 4, 12, 2, 10, 6, 14,
                                              1, 9, 5, 13, 3, 11, 7, 15};
        const __m128 zero = _mm_setzero_ps(), vs = _mm_set1_ps(s);
        const __m128 vms = _mm_set1_ps(-s);
        for (; j + 8 <= n; j += 8) {
            __m128 x0 = _mm_loadu_ps(pv + j), x1 = _mm_loadu_ps(pv + j + 4);
            __m128 g0 = _mm_cmpgt_ps(x0, zero), g1 = _mm_cmpgt_ps(x1, zero);
            unsigned byte = (unsigned)REVERSED4[_mm_movemask_ps(g0)] << 4
                | REVERSED4[_mm_movemask_ps(g1)];
            unsigned zeros = (unsigned)_mm_movemask_ps(_mm_cmpeq_ps(x0, zero))
                | (unsigned)_mm_movemask_ps(_mm_cmpeq_ps(x1, zero)) << 4;
            if (rv) {  /* x - (x > 0 ? s : -s) */
                _mm_storeu_ps(rv + j, _mm_sub_ps(x0, _mm_or_ps(
                    _mm_and_ps(g0, vs), _mm_andnot_ps(g0, vms))));
                _mm_storeu_ps(rv + j + 4, _mm_sub_ps(x1, _mm_or_ps(
                    _mm_and_ps(g1, vs), _mm_andnot_ps(g1, vms))));
            }
            for (int k = 0; zeros && k < 8; k++)  /* rare: the coin */
                if (zeros & (1u << k)) {
                    unsigned bit = coin((uint64_t)(first + j + k), salt);
                    byte |= bit << (7 - k);
                    if (rv) rv[j + k] = pv[j + k] - both[bit];
                }
            bv[(first + j) >> 3] = (uint8_t)byte;
        }
#endif
        for (; j < n; j++)
            encode_one(pv, rv, bv, j, first, salt, both);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&p);
    PyBuffer_Release(&bits);
    if (res.obj) PyBuffer_Release(&res);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* decode(bits, first, scale, out f32[n]): out[j] = +-scale as bit
 * first+j says. */
static PyObject *py_decode(PyObject *m, PyObject *args)
{
    Py_buffer bits, out;
    Py_ssize_t first;
    double scale_d;
    if (!PyArg_ParseTuple(args, "y*ndw*", &bits, &first, &scale_d, &out))
        return NULL;
    Py_ssize_t n = out.len / 4;
    if (check_bits(&bits, first, n) == 0) {
        const uint8_t *bv = (const uint8_t *)bits.buf;
        float *ov = (float *)out.buf;
        const float both[2] = {-(float)scale_d, (float)scale_d};
        Py_BEGIN_ALLOW_THREADS
        Py_ssize_t j = 0;
        for (; j < n && ((first + j) & 7); j++)
            ov[j] = both[get_bit(bv, first + j)];
        for (; j + 8 <= n; j += 8) {
            unsigned byte = bv[(first + j) >> 3];
            for (int k = 0; k < 8; k++)
                ov[j + k] = both[(byte >> (7 - k)) & 1u];
        }
        for (; j < n; j++)
            ov[j] = both[get_bit(bv, first + j)];
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&bits);
    PyBuffer_Release(&out);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* add_bits(bits, first, counts u8[n]): counts[j] += bit first+j. */
static PyObject *py_add_bits(PyObject *m, PyObject *args)
{
    Py_buffer bits, counts;
    Py_ssize_t first;
    if (!PyArg_ParseTuple(args, "y*nw*", &bits, &first, &counts))
        return NULL;
    Py_ssize_t n = counts.len;
    if (check_bits(&bits, first, n) == 0) {
        const uint8_t *bv = (const uint8_t *)bits.buf;
        uint8_t *cv = (uint8_t *)counts.buf;
        Py_BEGIN_ALLOW_THREADS
        Py_ssize_t j = 0;
        if (WORDS && (first & 7) == 0)
            /* Counts stay below 256: no carry crosses a byte. */
            for (; j + 8 <= n; j += 8)
                store64(cv + j, load64(cv + j) + SPREAD[bv[(first + j) >> 3]]);
        for (; j < n; j++)
            cv[j] = (uint8_t)(cv[j] + get_bit(bv, first + j));
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&bits);
    PyBuffer_Release(&counts);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* pack_counts(counts u8[n], nbits, out): bit-plane k of the counts,
 * packed, at out[k * ceil(n/8):]. */
static PyObject *py_pack_counts(PyObject *m, PyObject *args)
{
    Py_buffer counts, out;
    int nbits;
    if (!PyArg_ParseTuple(args, "y*iw*", &counts, &nbits, &out))
        return NULL;
    Py_ssize_t n = counts.len, plane = (n + 7) / 8;
    if (nbits >= 0 && nbits <= 8 && check(&out, nbits * plane, "out") == 0) {
        const uint8_t *cv = (const uint8_t *)counts.buf;
        uint8_t *ov = (uint8_t *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        Py_ssize_t b0 = 0;
        if (WORDS)
            for (; b0 < n / 8; b0++) {
                uint64_t w = load64(cv + 8 * b0);
                for (int q = 0; q < nbits; q++)
                    ov[q * plane + b0] =
                        (uint8_t)((((w >> q) & LSB8) * GATHER) >> 56);
            }
        for (Py_ssize_t b = b0; b < plane; b++) {
            unsigned acc[8] = {0};
            for (int k = 0; k < 8; k++) {
                Py_ssize_t j = 8 * b + k;
                unsigned c = j < n ? cv[j] : 0;
                for (int q = 0; q < nbits; q++)
                    acc[q] |= ((c >> q) & 1u) << (7 - k);
            }
            for (int q = 0; q < nbits; q++)
                ov[q * plane + b] = (uint8_t)acc[q];
        }
        Py_END_ALLOW_THREADS
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "nbits must be 0..8");
    }
    PyBuffer_Release(&counts);
    PyBuffer_Release(&out);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* unpack_counts(packed, nbits, counts u8[n]): the inverse, into counts. */
static PyObject *py_unpack_counts(PyObject *m, PyObject *args)
{
    Py_buffer packed, counts;
    int nbits;
    if (!PyArg_ParseTuple(args, "y*iw*", &packed, &nbits, &counts))
        return NULL;
    Py_ssize_t n = counts.len, plane = (n + 7) / 8;
    if (nbits >= 0 && nbits <= 8
            && check(&packed, nbits * plane, "packed") == 0) {
        const uint8_t *pv = (const uint8_t *)packed.buf;
        uint8_t *cv = (uint8_t *)counts.buf;
        Py_BEGIN_ALLOW_THREADS
        Py_ssize_t j = 0;
        if (WORDS)
            for (; j + 8 <= n; j += 8) {
                uint64_t w = 0;
                for (int q = 0; q < nbits; q++)
                    w |= SPREAD[pv[q * plane + j / 8]] << q;
                store64(cv + j, w);
            }
        for (; j < n; j++) {
            unsigned c = 0;
            for (int q = 0; q < nbits; q++)
                c |= get_bit(pv + q * plane, j) << q;
            cv[j] = (uint8_t)c;
        }
        Py_END_ALLOW_THREADS
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "nbits must be 0..8");
    }
    PyBuffer_Release(&packed);
    PyBuffer_Release(&counts);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS,
     "encode(p, scale, bits, first, step, residual_or_None)"},
    {"decode", py_decode, METH_VARARGS, "decode(bits, first, scale, out)"},
    {"add_bits", py_add_bits, METH_VARARGS, "add_bits(bits, first, counts)"},
    {"pack_counts", py_pack_counts, METH_VARARGS,
     "pack_counts(counts_u8, nbits, out)"},
    {"unpack_counts", py_unpack_counts, METH_VARARGS,
     "unpack_counts(packed, nbits, counts_u8)"},
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_signbits",
    "Sign-compression loops for mnopt/codecs/sign.py", -1, methods
};

PyMODINIT_FUNC PyInit__signbits(void)
{
    init_spread();
    return PyModule_Create(&module);
}
