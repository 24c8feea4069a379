/* Fast float32 <-> float16/bfloat16 conversions and 16-bit sums.
 *
 * numpy < 2 (which Chainer needs) converts float16 element by element at
 * 1-4 ns per element; these loops run at memory speed.  float16 uses the
 * F16C instructions when the CPU has them (checked at run time) and a
 * portable bit-exact routine otherwise; bfloat16 is plain integer
 * arithmetic that compilers vectorise.  Every result is bit-identical to
 * the numpy reference in grad_buffer.py: scale in float32, round once to
 * nearest-even, keep NaN a NaN.
 *
 * All functions take contiguous buffers (anything with the buffer
 * protocol) and release the GIL.  Encodes return how many source values
 * were not finite (NaN or infinite), decodes how many results are not: the
 * two counts that tell an overflow on the wire from gradients that were
 * already non-finite, at no extra pass over memory.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_X86 1
#endif

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ---------------------------------------------------------- bfloat16 */
static inline uint16_t bf16_round(float f)
{
    /* Branch-free, so the loops below vectorise. */
    uint32_t u = f2u(f);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}
static inline float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }
/* Not finite: all exponent bits set (the sign and mantissa do not matter). */
static inline int f32_bad(float f) { return (f2u(f) & 0x7F800000u) == 0x7F800000u; }
static inline int bf16_bad(uint16_t h) { return (h & 0x7F80u) == 0x7F80u; }
static inline int f16_bad(uint16_t h) { return (h & 0x7C00u) == 0x7C00u; }

/* ---------------------------------------------------------- float16 */
/* Portable round-to-nearest-even float32 -> float16 (as numpy does). */
static uint16_t f16_round(float f)
{
    uint32_t x = f2u(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t abs = x & 0x7FFFFFFFu;
    if (abs >= 0x7F800000u)                       /* inf or NaN */
        return sign | (abs > 0x7F800000u ? 0x7E00u : 0x7C00u);
    if (abs >= 0x477FF000u)                       /* rounds to >= 65520 */
        return sign | 0x7C00u;
    if (abs < 0x38800000u) {                      /* below 2^-14: subnormal */
        if (abs < 0x33000000u)                    /* below 2^-25: to zero */
            return sign;
        uint32_t exp = abs >> 23;
        uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
        uint32_t shift = 126 - exp;               /* 14..24 */
        uint32_t half = mant >> shift;
        uint32_t rest = mant & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1u)))
            half++;
        return sign | (uint16_t)half;
    }
    uint32_t r = abs + 0xFFFu + ((abs >> 13) & 1u);  /* round mantissa */
    return sign | (uint16_t)((r - 0x38000000u) >> 13);
}

static float f16_to_f32_portable(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (exp == 0x1F)
        return u2f(sign | 0x7F800000u | (mant << 13));
    if (exp == 0) {
        if (mant == 0)
            return u2f(sign);
        float f = (float)mant * (1.0f / 16777216.0f);  /* mant * 2^-24 */
        return u2f(f2u(f) | sign);
    }
    return u2f(sign | ((exp + 112) << 23) | (mant << 13));
}

#ifdef HAVE_X86
static int has_f16c = -1;
static int f16c(void)
{
    if (has_f16c < 0) {
        __builtin_cpu_init();
        has_f16c = __builtin_cpu_supports("f16c") &&
                   __builtin_cpu_supports("avx");
    }
    return has_f16c;
}

__attribute__((target("avx,f16c")))
static Py_ssize_t enc_f16_x86(const float *s, uint16_t *d, Py_ssize_t n,
                              float div)
{
    Py_ssize_t i = 0, bad = 0;
    __m256 vd = _mm256_set1_ps(div);
    __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 inf = _mm256_set1_ps(INFINITY);
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(s + i);
        /* !(|x| < inf): NaN or infinite */
        bad += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(
            _mm256_and_ps(x, abs_mask), inf, _CMP_NLT_UQ)));
        _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(
            _mm256_div_ps(x, vd), _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; i++) {
        bad += f32_bad(s[i]);
        d[i] = f16_round(s[i] / div);
    }
    return bad;
}

__attribute__((target("avx,f16c")))
static Py_ssize_t dec_f16_x86(const uint16_t *s, float *d, Py_ssize_t n)
{
    Py_ssize_t i = 0, bad = 0;
    __m128i exp_mask = _mm_set1_epi16(0x7C00);
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(s + i));
        /* two mask bits per 16-bit lane */
        bad += __builtin_popcount(_mm_movemask_epi8(_mm_cmpeq_epi16(
            _mm_and_si128(h, exp_mask), exp_mask))) >> 1;
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(h));
    }
    for (; i < n; i++) {
        bad += f16_bad(s[i]);
        d[i] = f16_to_f32_portable(s[i]);
    }
    return bad;
}

__attribute__((target("avx,f16c")))
static void sum_f16_x86(const uint16_t *a, uint16_t *b, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));
        _mm_storeu_si128((__m128i *)(b + i), _mm256_cvtps_ph(
            _mm256_add_ps(x, y), _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; i++)
        b[i] = f16_round(f16_to_f32_portable(a[i]) + f16_to_f32_portable(b[i]));
}
#endif

/* ---------------------------------------------------------- loops */
/* The bfloat16 loops are plain C: let the loader pick an AVX2 build of
 * them where the CPU has it (glibc ifunc), SSE2 otherwise. */
#if defined(HAVE_X86) && defined(__linux__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif
static Py_ssize_t enc_f16(const float *s, uint16_t *d, Py_ssize_t n,
                          float div)
{
#ifdef HAVE_X86
    if (f16c()) return enc_f16_x86(s, d, n, div);
#endif
    Py_ssize_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        bad += f32_bad(s[i]);
        d[i] = f16_round(s[i] / div);
    }
    return bad;
}
static Py_ssize_t dec_f16(const uint16_t *s, float *d, Py_ssize_t n)
{
#ifdef HAVE_X86
    if (f16c()) return dec_f16_x86(s, d, n);
#endif
    Py_ssize_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        bad += f16_bad(s[i]);
        d[i] = f16_to_f32_portable(s[i]);
    }
    return bad;
}
static void sum_f16(const uint16_t *a, uint16_t *b, Py_ssize_t n)
{
#ifdef HAVE_X86
    if (f16c()) { sum_f16_x86(a, b, n); return; }
#endif
    for (Py_ssize_t i = 0; i < n; i++)
        b[i] = f16_round(f16_to_f32_portable(a[i]) + f16_to_f32_portable(b[i]));
}
VECTOR_CLONES
static Py_ssize_t enc_bf16(const float *s, uint16_t *d, Py_ssize_t n,
                           float div)
{
    Py_ssize_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        bad += f32_bad(s[i]);
        d[i] = bf16_round(s[i] / div);
    }
    return bad;
}
VECTOR_CLONES
static Py_ssize_t dec_bf16(const uint16_t *s, float *d, Py_ssize_t n)
{
    Py_ssize_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        bad += bf16_bad(s[i]);
        d[i] = bf16_to_f32(s[i]);
    }
    return bad;
}
VECTOR_CLONES
static void sum_bf16(const uint16_t *a, uint16_t *b, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        b[i] = bf16_round(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

/* ---------------------------------------------------------- Python glue */
static int check_sizes(Py_buffer *src, Py_ssize_t src_item, Py_buffer *dst,
                       Py_ssize_t dst_item)
{
    if (src->len % src_item || dst->len % dst_item ||
        src->len / src_item != dst->len / dst_item) {
        PyErr_Format(PyExc_ValueError,
                     "buffers of %zd and %zd bytes do not hold the same "
                     "number of elements", src->len, dst->len);
        return -1;
    }
    return 0;
}

typedef Py_ssize_t (*enc_fn)(const float *, uint16_t *, Py_ssize_t, float);
typedef Py_ssize_t (*dec_fn)(const uint16_t *, float *, Py_ssize_t);
typedef void (*sum_fn)(const uint16_t *, uint16_t *, Py_ssize_t);

static PyObject *run_encode(PyObject *args, enc_fn fn)
{
    Py_buffer src, dst;
    double div;
    Py_ssize_t bad = 0;
    if (!PyArg_ParseTuple(args, "y*w*d", &src, &dst, &div))
        return NULL;
    if (check_sizes(&src, 4, &dst, 2) == 0) {
        Py_BEGIN_ALLOW_THREADS
        bad = fn((const float *)src.buf, (uint16_t *)dst.buf, src.len / 4,
                 (float)div);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromSsize_t(bad);
}

static PyObject *run_decode(PyObject *args, dec_fn fn)
{
    Py_buffer src, dst;
    Py_ssize_t bad = 0;
    if (!PyArg_ParseTuple(args, "y*w*", &src, &dst))
        return NULL;
    if (check_sizes(&src, 2, &dst, 4) == 0) {
        Py_BEGIN_ALLOW_THREADS
        bad = fn((const uint16_t *)src.buf, (float *)dst.buf, src.len / 2);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromSsize_t(bad);
}

static PyObject *run_sum(PyObject *args, sum_fn fn)
{
    Py_buffer a, b;
    if (!PyArg_ParseTuple(args, "y*w*", &a, &b))
        return NULL;
    if (check_sizes(&a, 2, &b, 2) == 0) {
        Py_BEGIN_ALLOW_THREADS
        fn((const uint16_t *)a.buf, (uint16_t *)b.buf, a.len / 2);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* Tests force the portable float16 loops on CPUs that have F16C. */
static PyObject *py_use_f16c(PyObject *m, PyObject *a)
{
    int on;
    if (!PyArg_ParseTuple(a, "p", &on))
        return NULL;
#ifdef HAVE_X86
    has_f16c = -1;
    if (!on || !f16c())
        has_f16c = 0;
    return PyBool_FromLong(has_f16c);
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *py_enc_f16(PyObject *m, PyObject *a) { return run_encode(a, enc_f16); }
static PyObject *py_dec_f16(PyObject *m, PyObject *a) { return run_decode(a, dec_f16); }
static PyObject *py_sum_f16(PyObject *m, PyObject *a) { return run_sum(a, sum_f16); }
static PyObject *py_enc_bf16(PyObject *m, PyObject *a) { return run_encode(a, enc_bf16); }
static PyObject *py_dec_bf16(PyObject *m, PyObject *a) { return run_decode(a, dec_bf16); }
static PyObject *py_sum_bf16(PyObject *m, PyObject *a) { return run_sum(a, sum_bf16); }

static PyMethodDef methods[] = {
    {"encode_float16", py_enc_f16, METH_VARARGS,
     "encode_float16(float32 src, uint16 dst, divisor): dst = f16(src / "
     "divisor); returns how many src values are not finite"},
    {"decode_float16", py_dec_f16, METH_VARARGS,
     "decode_float16(uint16 src, float32 dst): dst = f32(src); returns how "
     "many are not finite"},
    {"sum_float16", py_sum_f16, METH_VARARGS,
     "sum_float16(uint16 a, uint16 b): b = f16(f32(a) + f32(b))"},
    {"encode_bfloat16", py_enc_bf16, METH_VARARGS,
     "encode_bfloat16(float32 src, uint16 dst, divisor): as encode_float16"},
    {"decode_bfloat16", py_dec_bf16, METH_VARARGS,
     "decode_bfloat16(uint16 src, float32 dst): as decode_float16"},
    {"sum_bfloat16", py_sum_bf16, METH_VARARGS,
     "sum_bfloat16(uint16 a, uint16 b): b = bf16(f32(a) + f32(b))"},
    {"use_f16c", py_use_f16c, METH_VARARGS,
     "use_f16c(on): use F16C when the CPU has it (default); returns whether "
     "it is in use"},
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_halfcast",
    "Fast float16/bfloat16 conversions and sums (see _halfcast.c).", -1,
    methods
};

/* Bumped when a function's contract changes (2: encodes and decodes return
 * counts of non-finite values), so a stale build is not used. */
#define HALFCAST_API 2

PyMODINIT_FUNC PyInit__halfcast(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "API", HALFCAST_API) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
