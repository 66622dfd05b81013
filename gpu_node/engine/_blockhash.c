/*
 * Chained keyed BLAKE2b block hashes in one call: the hot loop of prefix lookup, without a Python call per block.
 *
 *   chain_hashes(key, parent, data, block_bytes, digest_size) -> bytes
 *
 * returns the concatenation of h_1..h_n for the n = len(data) // block_bytes full blocks of `data`, where
 *   h_0 = parent,  h_i = BLAKE2b(key=key, digest_size)(h_{i-1} || data[(i-1)*block_bytes : i*block_bytes])
 * byte for byte what hashlib.blake2b computes (tests compare the two). BLAKE2b is written here from RFC 7693; the
 * state after the key block is computed once per call and reused for every block.
 *
 *   chain_hashes_held(key, parent, data, block_bytes, digest_size, held, stride) -> (bytes, num_held)
 *
 * the same chain, computed only as far as `held` (any container: `h in held`) holds it: lookup's early exit.
 * See gpu_node/block_hash.py (chain_hashes_held_python is the reference).
 *
 *   int32_tokens(tokens, out) -> bool
 *
 * a list or tuple of exact Python ints in [0, 2**31) written into `out` (a writable int32 buffer of that length);
 * False, with `out` partly written, as soon as an item is anything else (the caller takes numpy's slower path,
 * which refuses or converts it exactly as before).
 *
 *   int32_nonnegative(tokens) -> bool
 *
 * True when no int32 of a contiguous buffer is negative: the only check an int32 array of token ids needs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BLAKE2B_BLOCK 128
#define MAX_DIGEST 64
#define MAX_KEY 64

static const uint64_t blake2b_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t blake2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

typedef struct {
    uint64_t h[8];
    uint64_t bytes_compressed; /* the counter t (messages here stay far below 2**64 bytes) */
} blake2b_state;

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load_le64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* little-endian hosts only: checked at module init */
    return v;
}

#define G(a, b, c, d, x, y)            \
    do {                               \
        v[a] = v[a] + v[b] + (x);      \
        v[d] = rotr64(v[d] ^ v[a], 32); \
        v[c] = v[c] + v[d];            \
        v[b] = rotr64(v[b] ^ v[c], 24); \
        v[a] = v[a] + v[b] + (y);      \
        v[d] = rotr64(v[d] ^ v[a], 16); \
        v[c] = v[c] + v[d];            \
        v[b] = rotr64(v[b] ^ v[c], 63); \
    } while (0)

static void blake2b_compress(blake2b_state *s, const uint8_t block[BLAKE2B_BLOCK], int is_last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load_le64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = blake2b_iv[i];
    }
    v[12] ^= s->bytes_compressed;
    if (is_last) v[14] = ~v[14];
#pragma GCC unroll 12
    for (int r = 0; r < 12; r++) {
        const uint8_t *sg = blake2b_sigma[r];
        G(0, 4, 8, 12, m[sg[0]], m[sg[1]]);
        G(1, 5, 9, 13, m[sg[2]], m[sg[3]]);
        G(2, 6, 10, 14, m[sg[4]], m[sg[5]]);
        G(3, 7, 11, 15, m[sg[6]], m[sg[7]]);
        G(0, 5, 10, 15, m[sg[8]], m[sg[9]]);
        G(1, 6, 11, 12, m[sg[10]], m[sg[11]]);
        G(2, 7, 8, 13, m[sg[12]], m[sg[13]]);
        G(3, 4, 9, 14, m[sg[14]], m[sg[15]]);
    }
    for (int i = 0; i < 8; i++) s->h[i] ^= v[i] ^ v[i + 8];
}

/* The state after the key block: every hash under this key starts from it (the key block is never the last one,
 * since every message here is non-empty). */
static void blake2b_keyed_start(blake2b_state *s, const uint8_t *key, size_t key_len, size_t digest_size) {
    uint8_t block[BLAKE2B_BLOCK] = {0};
    memcpy(s->h, blake2b_iv, sizeof s->h);
    s->h[0] ^= 0x01010000ULL ^ ((uint64_t)key_len << 8) ^ (uint64_t)digest_size;
    s->bytes_compressed = 0;
    memcpy(block, key, key_len);
    s->bytes_compressed += BLAKE2B_BLOCK;
    blake2b_compress(s, block, 0);
}

/* Hash `head` (head_len bytes) followed by `tail` (together non-empty) from a keyed start state. */
static void blake2b_finish_two(blake2b_state s, const uint8_t *head, size_t head_len, const uint8_t *tail,
                               size_t tail_len, uint8_t *out, size_t digest_size) {
    uint8_t block[BLAKE2B_BLOCK];
    size_t total = head_len + tail_len, done = 0;
    while (done < total) {
        size_t take = total - done < BLAKE2B_BLOCK ? total - done : BLAKE2B_BLOCK;
        size_t filled = 0;
        if (done < head_len) { /* the part of this block that comes from head */
            filled = head_len - done < take ? head_len - done : take;
            memcpy(block, head + done, filled);
        }
        memcpy(block + filled, tail + (done + filled - head_len), take - filled);
        memset(block + take, 0, BLAKE2B_BLOCK - take);
        done += take;
        s.bytes_compressed += take;
        blake2b_compress(&s, block, done == total);
    }
    uint8_t full[MAX_DIGEST];
    for (int i = 0; i < 8; i++) memcpy(full + 8 * i, &s.h[i], 8);
    memcpy(out, full, digest_size);
}

static PyObject *chain_hashes(PyObject *self, PyObject *args) {
    Py_buffer key, parent, data;
    Py_ssize_t block_bytes, digest_size;
    if (!PyArg_ParseTuple(args, "y*y*y*nn", &key, &parent, &data, &block_bytes, &digest_size)) return NULL;
    PyObject *result = NULL;
    if (key.len < 1 || key.len > MAX_KEY || digest_size < 1 || digest_size > MAX_DIGEST ||
        parent.len != digest_size || block_bytes < 1) {
        PyErr_SetString(PyExc_ValueError, "chain_hashes: bad key, digest size, parent or block size");
        goto done;
    }
    Py_ssize_t num_blocks = data.len / block_bytes;
    result = PyBytes_FromStringAndSize(NULL, num_blocks * digest_size);
    if (result == NULL) goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    const uint8_t *bytes = (const uint8_t *)data.buf;
    blake2b_state start;
    Py_BEGIN_ALLOW_THREADS
    blake2b_keyed_start(&start, (const uint8_t *)key.buf, (size_t)key.len, (size_t)digest_size);
    const uint8_t *prev = (const uint8_t *)parent.buf;
    for (Py_ssize_t i = 0; i < num_blocks; i++) {
        uint8_t *digest = out + i * digest_size;
        blake2b_finish_two(start, prev, (size_t)digest_size, bytes + i * block_bytes, (size_t)block_bytes, digest,
                           (size_t)digest_size);
        prev = digest;
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&key);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return result;
}

/* 1 when `held` holds the digest, 0 when not, -1 with an exception set. */
static int held_contains(PyObject *held, const uint8_t *digest, Py_ssize_t digest_size) {
    PyObject *name = PyBytes_FromStringAndSize((const char *)digest, digest_size);
    if (name == NULL) return -1;
    int found = PySequence_Contains(held, name);
    Py_DECREF(name);
    return found;
}

/* Hash block by block, probing `held` with the digest of every `stride`-th block (and of the last one); at the first
 * probe that misses, a binary search over that stride's blocks finds the first missing one. With stride > 1 that is
 * right only when presence along the chain is monotone (held prefix closed: a held block's parent is held); with
 * stride 1 every block is probed and the answer is the leading run, whatever `held` is. The GIL stays held throughout
 * (probes need it, and releasing it per stride would queue behind other threads); no Python code runs between probes
 * unless `held` is a Python-level container. */
static PyObject *chain_hashes_held(PyObject *self, PyObject *args) {
    Py_buffer key, parent, data;
    Py_ssize_t block_bytes, digest_size, stride;
    PyObject *held;
    if (!PyArg_ParseTuple(args, "y*y*y*nnOn", &key, &parent, &data, &block_bytes, &digest_size, &held, &stride))
        return NULL;
    PyObject *digests = NULL, *result = NULL;
    if (key.len < 1 || key.len > MAX_KEY || digest_size < 1 || digest_size > MAX_DIGEST ||
        parent.len != digest_size || block_bytes < 1 || stride < 1) {
        PyErr_SetString(PyExc_ValueError, "chain_hashes_held: bad key, digest size, parent, block size or stride");
        goto done;
    }
    Py_ssize_t num_blocks = data.len / block_bytes;
    digests = PyBytes_FromStringAndSize(NULL, num_blocks * digest_size);
    if (digests == NULL) goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(digests);
    const uint8_t *bytes = (const uint8_t *)data.buf;
    blake2b_state start;
    blake2b_keyed_start(&start, (const uint8_t *)key.buf, (size_t)key.len, (size_t)digest_size);
    const uint8_t *prev = (const uint8_t *)parent.buf;
    Py_ssize_t computed = 0, num_held = 0; /* blocks [0, num_held) are held; [0, computed) are hashed */
    while (computed < num_blocks) {
        Py_ssize_t end = num_blocks - computed < stride ? num_blocks : computed + stride;
        for (; computed < end; computed++) {
            uint8_t *digest = out + computed * digest_size;
            blake2b_finish_two(start, prev, (size_t)digest_size, bytes + computed * block_bytes, (size_t)block_bytes,
                               digest, (size_t)digest_size);
            prev = digest;
        }
        int found = held_contains(held, out + (end - 1) * digest_size, digest_size);
        if (found < 0) goto done;
        if (found) {
            num_held = end;
            continue;
        }
        Py_ssize_t missing = end - 1; /* missing is not held; blocks before num_held are */
        while (num_held < missing) {
            Py_ssize_t middle = num_held + (missing - num_held) / 2;
            found = held_contains(held, out + middle * digest_size, digest_size);
            if (found < 0) goto done;
            if (found)
                num_held = middle + 1;
            else
                missing = middle;
        }
        break;
    }
    if (computed < num_blocks && _PyBytes_Resize(&digests, computed * digest_size) < 0) goto done;
    result = Py_BuildValue("(On)", digests, num_held);
done:
    Py_XDECREF(digests);
    PyBuffer_Release(&key);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return result;
}

static PyObject *int32_tokens(PyObject *self, PyObject *args) {
    PyObject *tokens;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "Ow*", &tokens, &out)) return NULL;
    PyObject *result = NULL;
    if (!PyList_CheckExact(tokens) && !PyTuple_CheckExact(tokens)) {
        PyErr_SetString(PyExc_TypeError, "int32_tokens: a list or tuple");
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
    if (out.len != n * (Py_ssize_t)sizeof(int32_t)) {
        PyErr_SetString(PyExc_ValueError, "int32_tokens: `out` must hold exactly one int32 per token");
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(tokens);
    int32_t *ids = (int32_t *)out.buf;
    int ok = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        int overflow;
        long value;
        if (!PyLong_CheckExact(item) || (value = PyLong_AsLongAndOverflow(item, &overflow), overflow) || value < 0 ||
            value > INT32_MAX) {
            ok = 0;
            break;
        }
        int32_t id = (int32_t)value;
        memcpy(ids + i, &id, sizeof id);
    }
    result = PyBool_FromLong(ok);
done:
    PyBuffer_Release(&out);
    return result;
}

/* True when every int32 of `tokens` (a contiguous buffer of them) is a token id, i.e. not negative: sign bits ORed
 * eight ids at a time, instead of numpy's min() and its ~1 us of call overhead. */
static PyObject *int32_nonnegative(PyObject *self, PyObject *args) {
    Py_buffer tokens;
    if (!PyArg_ParseTuple(args, "y*", &tokens)) return NULL;
    const uint8_t *bytes = (const uint8_t *)tokens.buf;
    Py_ssize_t n = tokens.len / 4, i = 0;
    uint64_t acc[4] = {0, 0, 0, 0};
    for (; i + 8 <= n; i += 8) {
        uint64_t words[4];
        memcpy(words, bytes + i * 4, sizeof words);
        acc[0] |= words[0];
        acc[1] |= words[1];
        acc[2] |= words[2];
        acc[3] |= words[3];
    }
    uint64_t any = acc[0] | acc[1] | acc[2] | acc[3];
    for (; i < n; i++) {
        uint32_t id;
        memcpy(&id, bytes + i * 4, sizeof id);
        any |= id;
    }
    PyBuffer_Release(&tokens);
    return PyBool_FromLong((any & 0x8000000080000000ULL) == 0);
}

static PyMethodDef methods[] = {
    {"chain_hashes", chain_hashes, METH_VARARGS,
     "chain_hashes(key, parent, data, block_bytes, digest_size) -> concatenated chained keyed BLAKE2b digests"},
    {"chain_hashes_held", chain_hashes_held, METH_VARARGS,
     "chain_hashes_held(key, parent, data, block_bytes, digest_size, held, stride) -> (digests, num_held): the chain "
     "as far as `held` holds it (see gpu_node/block_hash.py)"},
    {"int32_tokens", int32_tokens, METH_VARARGS,
     "int32_tokens(tokens, out) -> bool: exact ints in [0, 2**31) of a list or tuple into an int32 buffer"},
    {"int32_nonnegative", int32_nonnegative, METH_VARARGS,
     "int32_nonnegative(tokens) -> bool: no int32 of the contiguous buffer `tokens` is negative"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockhash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockhash(void) {
    const uint16_t probe = 1;
    if (*(const uint8_t *)&probe != 1) {
        PyErr_SetString(PyExc_ImportError, "_blockhash supports little-endian hosts only");
        return NULL;
    }
    return PyModule_Create(&module);
}
