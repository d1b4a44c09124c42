/* An exact int8 x int8 -> int32 GEMM for the CPU linear layers: C[m, n] = sum_k A[m, k] * W[n, k].
 *
 * It replaces torch._int_mm(A, W.t()) without changing a bit: every product and partial sum is an
 * integer that int32 holds exactly (bounds per path below), so blocking, vector width, thread count
 * and the order of summation cannot change the result: integer addition is associative. Exactness
 * could only be lost to saturation or overflow, and no path here saturates or overflows.
 *
 * The weight is packed once (int8_gemm_pack) into blocks of 16 output channels with K in groups of
 * 4 bytes, packed[block][group][16][4] (K padded to a multiple of 4 and N to a multiple of 16, with
 * zeros: a zero weight adds nothing), so that one 64-byte vector holds 4 consecutive k of 16
 * channels: the operand layout of AVX-512 VNNI's vpdpbusd, which adds 4 u8 x s8 products into each
 * int32 lane.
 *
 * Paths (int8_gemm_isa() says which one runs):
 *   3  AMX-INT8 (Intel Xeon 4th generation and later; Linux, which must grant the process the tile
 *      state once: arch_prctl ARCH_REQ_XCOMP_PERM) for calls of AMX_MIN_ROWS rows or more where K is
 *      a multiple of 64, the AVX-512 VNNI path below for the rest. tdpbusd is vpdpbusd on 16 x 16
 *      tiles: the same u8 x s8 products of the same offset operands, summed into int32 lanes
 *      without saturation, so the same integers by the same bounds; and the packed layout below is
 *      already its B operand (a tile of 16 k groups of one block is 1 KB, rows 64 bytes apart).
 *      About 10x vpdpbusd's multiply-adds per cycle: a verify pass of many rows costs what a
 *      one-row pass costs, the weights' streaming from memory.
 *   2  AVX-512 VNNI. vpdpbusd takes unsigned bytes on one side, so A is offset to A + 128 (A xor 0x80,
 *      in [0, 255]) and 128 * colsum(W[n]) is subtracted at the end:
 *          sum_k (A + 128) W = sum_k A W + 128 sum_k W      (an identity of integers).
 *      vpdpbusd (not the saturating vpdpbusds) adds modulo 2^32, and nothing even wraps: every partial
 *      sum is bounded by 255 * 127 * K < 2^31 for K < 66,000, and 128 * |colsum| <= 128 * 127 * K.
 *      (Beyond that, arithmetic modulo 2^32 would still give the exact result, which fits in int32.)
 *   1  AVX2. vpmaddubsw would SATURATE to int16 (255 * 127 * 2 > 32767), so this path does not use
 *      it: both operands are sign-extended to int16 and multiplied with vpmaddwd, whose pair sums
 *      (|a w + a' w'| <= 2 * 128 * 128) and int32 accumulations are exact.
 *   0  portable C: int32 multiply-adds of the signed values, the same integers.
 * Define INT8_GEMM_FORCE_ISA=0, 1 or 2 to compile a lower path (the tests check every path this way).
 *
 * Speed (AVX-512 path). The weights are the big operand at decode sizes, A is small and stays in
 * cache, so each weight vector is read from memory once per call for all M rows. A thread takes a
 * contiguous range of 16-channel blocks (threads split N, so at small M every core streams memory),
 * processes up to 4 blocks at once (a "panel") and, for each panel, every tile of up to 6 rows (8 or
 * 12 for a narrower panel), with up to 24 zmm accumulators; the rows are split into tiles of equal
 * size (within one). The panel's first pass prefetches its own streams ahead; with several passes,
 * each one also prefetches a share of the next panel into L2, so the memory reads of the next panel
 * overlap the compute of this one (at M = 32..128 the kernel is compute-bound and near vpdpbusd's
 * peak). The accumulators are named variables and vpdpbusd is inline asm, because GCC 12 spills an
 * array of accumulators and spills even named ones around the intrinsic.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int8_rows.h"
#include "pool.h"

#if defined(INT8_GEMM_FORCE_ISA)
#define ISA_CAP INT8_GEMM_FORCE_ISA
#else
#define ISA_CAP 3
#endif

#if ISA_CAP >= 2 && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define ISA 2
#include <immintrin.h>
#elif ISA_CAP >= 1 && defined(__AVX2__)
#define ISA 1
#include <immintrin.h>
#else
#define ISA 0
#endif

#if ISA == 2 && ISA_CAP >= 3 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define AMX 1
#include "amx_tiles.h"
#else
#define AMX 0
#endif

#define BLOCK 16 /* output channels per packed block */
#define GROUP 4  /* k per group */

/* Which path runs: 3 AMX-INT8 (with AVX-512 VNNI for few rows), 2 AVX-512 VNNI, 1 AVX2 (vpmaddwd),
 * 0 portable C. */
int int8_gemm_isa(void) {
#if AMX
    if (amx_usable()) return 3;
#endif
    return ISA;
}

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/* Bytes of the packed form of a weight [n, k] (int8_gemm_pack writes this many). */
int64_t int8_gemm_packed_size(int64_t n, int64_t k) { return round_up(n, BLOCK) * round_up(k, GROUP); }

/* W int8 [n, k] (row stride ldw) -> packed[block][group][16][4] (zero padded) and colsums int32
 * [round_up(n, 16)] (the exact sum of each channel's weights, |sum| <= 128 * K; 0 for padding
 * channels). Blocks are independent: one pool task each. */
struct pack_job {
    const int8_t *w;
    int64_t n, k, ldw;
    int8_t *packed;
    int32_t *colsums;
};

static void pack_block(void *context, int64_t b) {
    const struct pack_job *job = context;
    int64_t n = job->n, k = job->k, kp = round_up(k, GROUP), full = k / GROUP;
    int8_t *out = job->packed + b * BLOCK * kp;
    if (b * BLOCK + BLOCK > n || k != kp) memset(out, 0, (size_t)(BLOCK * kp));
    for (int64_t j = 0; j < BLOCK; j++) {
        int64_t ch = b * BLOCK + j;
        if (ch >= n) {
            job->colsums[ch] = 0;
            continue;
        }
        const int8_t *row = job->w + ch * job->ldw;
        int32_t sum = 0;
        for (int64_t kk = 0; kk < k; kk++) sum += row[kk];
        job->colsums[ch] = sum;
        for (int64_t g = 0; g < full; g++) memcpy(out + (g * BLOCK + j) * GROUP, row + g * GROUP, GROUP);
        for (int64_t kk = full * GROUP; kk < k; kk++) out[(full * BLOCK + j) * GROUP + kk - full * GROUP] = row[kk];
    }
}

void int8_gemm_pack(const int8_t *w, int64_t n, int64_t k, int64_t ldw, int8_t *packed, int32_t *colsums,
                    int threads) {
    struct pack_job job = {w, n, k, ldw, packed, colsums};
    pool_for(threads, round_up(n, BLOCK) / BLOCK, pack_block, &job);
}

/* Thread t's share of `count` items (blocks of channels, or rows): [*lo, *hi). */
static inline void share(int64_t count, int threads, int t, int64_t *lo, int64_t *hi) {
    *lo = count * t / threads;
    *hi = count * (t + 1) / threads;
}

#if ISA == 2
#define PANEL 4    /* blocks of 16 channels processed at once */
#ifndef PREFETCH
#define PREFETCH 1024 /* bytes ahead in each block's stream */
#endif
#define MAX_ROWS 12


/* acc + the 4-byte dot products of a (u8) and w (s8) per int32 lane, wrapping (never saturating).
 * Inline asm rather than the intrinsic: with the intrinsic GCC 12 spills half the accumulators. */
static inline __attribute__((always_inline)) __m512i dpbusd(__m512i acc, __m512i a, __m512i w) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(w));
    return acc;
}

static inline __m512i broadcast4(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* The accumulators are named variables, not an array: GCC keeps those in registers, an array of
 * vectors it spills. ACC(j, i): block j of the panel, row i. */
#define ACC(j, i) acc##j##_##i
#define FOR_ROWS(X, j) X(j, 0) X(j, 1) X(j, 2) X(j, 3) X(j, 4) X(j, 5) X(j, 6) X(j, 7) X(j, 8) X(j, 9) X(j, 10) X(j, 11)
#define FOR_ALL(X) FOR_ROWS(X, 0) FOR_ROWS(X, 1) FOR_ROWS(X, 2) FOR_ROWS(X, 3)
#define DECLARE(j, i) __m512i ACC(j, i) = _mm512_setzero_si512();
#define MADD(j, i) \
    if (NB > j) ACC(j, i) = dpbusd(ACC(j, i), a, w##j);
#define ROW(_, i)                                                \
    if (MR > i) {                                                \
        __m512i a = broadcast4(au + i * kp + g * GROUP);         \
        MADD(0, i) MADD(1, i) MADD(2, i) MADD(3, i)              \
    }
#define STORE(j, i) \
    if (NB > j && MR > i) _mm512_mask_storeu_epi32((void *)(c + i * ldc + col##j), mask##j, _mm512_sub_epi32(ACC(j, i), fix##j));
#define LOAD_W(j)                                                                                  \
    __m512i w##j = _mm512_setzero_si512();                                                         \
    if (NB > j) {                                                                                  \
        w##j = _mm512_loadu_si512((const void *)(p + j * bstride));                               \
        if (PF == AHEAD) _mm_prefetch((const char *)(p + j * bstride + PREFETCH), _MM_HINT_T0);   \
    }
/* 128 * colsum, exact (|colsum| <= 127 * K), as a shift; the mask covers the channels below n. */
#define FIX(j)                                                                                     \
    int64_t col##j = n0 + j * BLOCK;                                                               \
    __m512i fix##j = _mm512_setzero_si512();                                                       \
    __mmask16 mask##j = 0;                                                                         \
    if (NB > j) {                                                                                  \
        fix##j = _mm512_slli_epi32(_mm512_loadu_si512((const void *)(cs + col##j)), 7);            \
        mask##j = col##j + BLOCK <= n ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - col##j)) - 1u); \
    }

/* Prefetch modes of a tile: none; AHEAD: PREFETCH bytes ahead in the panel's own streams (its
 * first pass, weights still in DRAM); NEXT: a share of the next panel into L2, one line of each of
 * its blocks every `every` k groups, so the DRAM reads of the next panel overlap this one's compute. */
enum { NONE = 0, AHEAD = 1, NEXT = 2 };

typedef struct {
    const int8_t *at; /* where this pass's share of the next panel starts (block 0), or NULL */
    int blocks;       /* blocks in the next panel */
    int64_t every;    /* k groups per prefetched line */
} next_share;

/* MR rows of au (u8 = A + 128, row stride kp) times NB consecutive blocks starting at wb, over
 * `groups` k groups (all of them, or one exponent block's: the block kernel). NB, MR and
 * PF are constants at every call site, so only the live accumulators remain, all in registers. */
static inline __attribute__((always_inline)) void tile(const int NB, const int MR, const int PF,
                                                       const uint8_t *au, int64_t kp, const int8_t *wb,
                                                       const int32_t *cs, int32_t *c, int64_t ldc, int64_t n0,
                                                       int64_t n, next_share next, int64_t groups) {
    const int64_t bstride = BLOCK * kp;
    const int8_t *q = next.at;
    int64_t countdown = next.every;
    FOR_ALL(DECLARE)
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *p = wb + g * (BLOCK * GROUP);
        LOAD_W(0) LOAD_W(1) LOAD_W(2) LOAD_W(3)
        if (PF == NEXT && q != NULL && --countdown == 0) {
            countdown = next.every;
            for (int j = 0; j < next.blocks; j++) _mm_prefetch((const char *)(q + j * bstride), _MM_HINT_T1);
            q += BLOCK * GROUP;
        }
        FOR_ROWS(ROW, 0)
    }
    FIX(0) FIX(1) FIX(2) FIX(3)
    FOR_ALL(STORE)
}

/* The block kernel: rows whose 16-bit integers are, per EXP_BLOCK of k, int8 mantissas times 2^e
 * (int8_rows.h), so one vpdpbusd pass over the mantissas replaces the two over the halves. After
 * each exponent block the tile's sums S (|S| <= 64 * 127 * 127 < 2^20, exact) are shifted into one
 * of two int32 sums kept in memory: c gets S << (e - 4) for e >= 4, low gets S << e for e < 4, so
 * c * 16 + low is the exact integer sum of the row's 16-bit integers times the weights, what the
 * halves give (256 * hi + lo), and neither sum can overflow while k <= BLOCK_MAX_K (|S << 4| <
 * 2^24, and at most 128 blocks). The offset's correction (128 * the block's colsum) comes off each
 * block's sums before the shift. */
#define CHUNK_GROUPS (EXP_BLOCK / GROUP)
#define BLOCK_MAX_K 8192

typedef struct {
    const uint8_t *exps;        /* the tile's first row's exponents; row i at exps + i * chunks */
    int64_t chunks;             /* exponent blocks per row */
    const int32_t *chunk_sums;  /* [chunks][round_up(n, 16)]: each channel's weight sum over each block */
    int32_t *low;               /* the second sums, laid out as c */
} block_sums;

/* One exponent block's sums S (raw [mr][PANEL * 16], the offset's correction already off: `tile`
 * with that block's chunk sums) added, shifted, into the two sums, row by row (see above). */
static void flush_sums(int nb, int mr, const int32_t *raw, const uint8_t *ex, int64_t chunks, int32_t *c,
                       int32_t *low, int64_t ldc, int64_t n0) {
    for (int i = 0; i < mr; i++) {
        int e = ex[i * chunks];
        int32_t *to = (e >= 4 ? c : low) + i * ldc + n0;
        __m128i count = _mm_cvtsi32_si128(e >= 4 ? e - 4 : e);
        for (int j = 0; j < nb; j++) {
            __m512i v = _mm512_sll_epi32(_mm512_load_si512((const void *)(raw + (i * PANEL + j) * BLOCK)), count);
            _mm512_store_si512((void *)(to + j * BLOCK), _mm512_add_epi32(_mm512_load_si512((const void *)(to + j * BLOCK)), v));
        }
    }
}

static const int ROWS_FOR[PANEL + 1] = {0, 12, 12, 8, 6}; /* rows per tile for a panel of NB blocks */

#define CASE(NB, MR, PF) \
    case MR:             \
        tile(NB, MR, PF, au, kp, wb, cs, c, ldc, n0, n, next, groups); \
        break;
#define CASES6(NB, PF) \
    CASE(NB, 1, PF) CASE(NB, 2, PF) CASE(NB, 3, PF) CASE(NB, 4, PF) CASE(NB, 5, PF) CASE(NB, 6, PF)
#define CASES8(NB, PF) CASES6(NB, PF) CASE(NB, 7, PF) CASE(NB, 8, PF)
#define CASES12(NB, PF) CASES8(NB, PF) CASE(NB, 9, PF) CASE(NB, 10, PF) CASE(NB, 11, PF) CASE(NB, 12, PF)
#define PANELS(PF)                                 \
    switch (nb) {                                  \
    case 4: switch (mr) { CASES6(4, PF) } break;   \
    case 3: switch (mr) { CASES8(3, PF) } break;   \
    case 2: switch (mr) { CASES12(2, PF) } break;  \
    case 1: switch (mr) { CASES12(1, PF) } break;  \
    }

static void dispatch(int nb, int mr, int pf, const uint8_t *au, int64_t kp, const int8_t *wb, const int32_t *cs,
                     int32_t *c, int64_t ldc, int64_t n0, int64_t n, next_share next, int64_t groups) {
    if (pf == AHEAD) {
        PANELS(AHEAD)
    } else if (pf == NEXT) {
        PANELS(NEXT)
    } else {
        PANELS(NONE)
    }
}

/* One tile of the block kernel: per exponent block of k, `tile` over its 16 k groups with that
 * block's chunk sums as the correction, into a scratch tile, then shifted into the two sums (a
 * call per block keeps `tile`'s one loop, which GCC compiles with every accumulator in place). */
static void run_exponent_blocks(int nb, int mr, int pf, const uint8_t *au, int64_t kp, const int8_t *wb,
                                const block_sums *blocks, int64_t r0, int32_t *c, int64_t ldc, int64_t n0, int64_t n,
                                next_share next) {
    int32_t raw[MAX_ROWS * PANEL * BLOCK] __attribute__((aligned(64)));
    if (n0 + nb * BLOCK > n) memset(raw, 0, sizeof raw); /* `tile` stores no channel past n */
    int32_t *low = blocks->low + r0 * ldc;
    const uint8_t *ex = blocks->exps + r0 * blocks->chunks;
    const int64_t groups = kp / GROUP, npad = round_up(n, BLOCK);
    for (int i = 0; i < mr; i++) {
        memset(c + i * ldc + n0, 0, sizeof(int32_t) * (size_t)(nb * BLOCK));
        memset(low + i * ldc + n0, 0, sizeof(int32_t) * (size_t)(nb * BLOCK));
    }
    int64_t lines = next.at ? CHUNK_GROUPS / next.every : 0; /* next-panel lines a block's groups fetch */
    for (int64_t chunk = 0; chunk < blocks->chunks; chunk++) {
        int64_t g0 = chunk * CHUNK_GROUPS, count = groups - g0 < CHUNK_GROUPS ? groups - g0 : CHUNK_GROUPS;
        next_share part = next;
        if (part.at) part.at += chunk * lines * (BLOCK * GROUP);
        dispatch(nb, mr, pf, au + g0 * GROUP, kp, wb + g0 * (BLOCK * GROUP), blocks->chunk_sums + chunk * npad,
                 raw - n0, PANEL * BLOCK, n0, n, part, count);
        flush_sums(nb, mr, raw, ex + chunk, blocks->chunks, c, low, ldc, n0);
    }
}

/* One thread's blocks [lo, hi): panels of up to 4 blocks, each against every block of rows. A
 * panel's first pass streams it from memory (prefetching ahead) unless the passes over the previous
 * panel already brought it into L2 (they do when there are several passes: each fetches a share). */
static void run_blocks(const uint8_t *au, int64_t m, int64_t kp, const int8_t *packed, const int32_t *colsums,
                       int64_t n, int32_t *c, int64_t ldc, int64_t lo, int64_t hi, const block_sums *blocks) {
    const int64_t groups = kp / GROUP;
    int fetched = 0; /* whether this panel was prefetched by the passes over the previous one */
    for (int64_t b = lo; b < hi; b += PANEL) {
        int nb = hi - b < PANEL ? (int)(hi - b) : PANEL;
        int64_t rows = ROWS_FOR[nb];
        int64_t tiles = (m + rows - 1) / rows; /* balanced row blocks: sizes differ by at most one */
        int64_t base = m / tiles, extra = m % tiles, r0 = 0;
        const int8_t *wb = packed + b * BLOCK * kp;
        int64_t after = b + nb, next_nb = hi - after < PANEL ? hi - after : PANEL;
        /* The passes that prefetch the next panel, and each one's share of its lines per block. */
        int64_t sharers = tiles - (fetched ? 0 : 1);
        int64_t share = sharers > 0 ? (groups + sharers - 1) / sharers : 0;
        for (int64_t t = 0, s = 0; t < tiles; t++) {
            int mr = (int)(base + (t < extra));
            next_share next = {NULL, 0, 1};
            int pf = NONE;
            if (t == 0 && !fetched) {
                pf = AHEAD;
            } else if (next_nb > 0 && share > 0) {
                pf = NEXT;
                next.at = packed + after * BLOCK * kp + s * share * (BLOCK * GROUP);
                next.blocks = (int)next_nb;
                next.every = groups / share > 0 ? groups / share : 1;
                s++;
            }
            if (blocks) {
                run_exponent_blocks(nb, mr, pf, au + r0 * kp, kp, wb, blocks, r0, c + r0 * ldc, ldc, b * BLOCK, n, next);
            } else {
                dispatch(nb, mr, pf, au + r0 * kp, kp, wb, colsums, c + r0 * ldc, ldc, b * BLOCK, n, next, groups);
            }
            r0 += mr;
        }
        fetched = sharers > 0 && next_nb > 0;
    }
}

#if AMX
/* The AMX path: tiles of 16 rows x 64 bytes everywhere. A tile of A is 16 prepared rows (u8) by
 * 64 k; a tile of B is one packed block's 16 k groups (16 rows of 16 channels x 4 k, 64 bytes
 * apart: 1 KB of the packed layout, as it lies); a tile of C is 16 rows x 16 int32 sums. Register
 * use: C 0..3, A 4 (and 5), B 5..7. The prepared rows are padded to a multiple of 16 with the
 * offset of zero (their sums are never stored). */
#define AMX_K 64         /* k per tile step */
#define AMX_MIN_ROWS 12  /* fewer rows (int8 halves) go to the VNNI tiles: memory-bound either way */

/* Whether a call of m rows (int8 halves) with kp (packed k) runs on the tiles. */
static inline int amx_runs(int64_t m, int64_t kp) { return m >= AMX_MIN_ROWS && kp % AMX_K == 0 && amx_usable(); }

#define AMX_AHEAD 4096 /* bytes ahead in the weight stream a k step asks for (into L1) */

/* One block (wb: its 16 k groups per tile, kp / 64 tiles one after the other) for up to 32 rows:
 * C tiles c0 (rows 0..15) and c1 (rows 16..31, when two), A tiles 4 and 5, B tile b. The block's
 * weights are read in memory order, and each k step asks for the line AMX_AHEAD bytes on. */
#define AMX_BLOCK(c0, c1, b, two)                                                         \
    do {                                                                                  \
        _tile_zero(c0);                                                                   \
        if (two) _tile_zero(c1);                                                          \
        for (int64_t s = 0; s < kp; s += AMX_K) {                                         \
            const int8_t *p = wb + s * BLOCK;                                             \
            for (int l = 0; l < 16; l++) _mm_prefetch((const char *)(p + AMX_AHEAD + 64 * l), _MM_HINT_T0); \
            _tile_loadd(b, p, 64);                                                        \
            _tile_loadd(4, au + s, kp);                                                   \
            _tile_dpbusd(c0, 4, b);                                                       \
            if (two) {                                                                    \
                _tile_loadd(5, au + 16 * kp + s, kp);                                     \
                _tile_dpbusd(c1, 5, b);                                                   \
            }                                                                             \
        }                                                                                 \
        _tile_stored(c0, out, BLOCK * 4);                                                 \
        if (two) _tile_stored(c1, out + 16 * BLOCK, BLOCK * 4);                           \
    } while (0)

/* Rows r0..r0+rows-1 of block b from the tile sums (out [32][16], row stride 16) into c, less
 * 128 * colsum (the offset of A), the channels below n only: what the VNNI tiles store. */
static inline void amx_store(const int32_t *out, int64_t rows, int64_t b, const int32_t *cs, int32_t *c, int64_t ldc,
                             int64_t n) {
    int64_t col = b * BLOCK;
    __m512i fix = _mm512_slli_epi32(_mm512_loadu_si512((const void *)(cs + col)), 7);
    __mmask16 mask = col + BLOCK <= n ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - col)) - 1u);
    for (int64_t i = 0; i < rows; i++)
        _mm512_mask_storeu_epi32((void *)(c + i * ldc + col), mask,
                                 _mm512_sub_epi32(_mm512_loadu_si512((const void *)(out + i * BLOCK)), fix));
}

/* One thread's blocks [lo, hi) for all m rows (au padded to a multiple of 16 rows), block after
 * block in the order they lie in memory (a thread's blocks are contiguous: one sequential stream
 * of weights, asked for AMX_AHEAD bytes ahead), each over the rows by 32; two sets of C tiles
 * alternate, so that one block's sums are stored while the next one's are computed. */
static void run_blocks_amx(const uint8_t *au, int64_t m, int64_t kp, const int8_t *packed, const int32_t *colsums,
                           int64_t n, int32_t *c, int64_t ldc, int64_t lo, int64_t hi) {
    int32_t out[32 * BLOCK];
    const int64_t bstride = BLOCK * kp;
    amx_configure_16x64();
    for (int64_t i = 0; i < AMX_AHEAD; i += 64) _mm_prefetch((const char *)(packed + lo * bstride + i), _MM_HINT_T0);
    for (int64_t r = 0; r < m; r += 32) {
        const uint8_t *rows_au = au + r * kp;
        int64_t rows = m - r < 32 ? m - r : 32;
        int two = rows > 16;
        for (int64_t b = lo; b < hi; b++) {
            const int8_t *wb = packed + b * bstride;
            const uint8_t *au_ = rows_au;
            {
                const uint8_t *au = au_;
                if (b & 1) {
                    if (two) AMX_BLOCK(1, 3, 7, 1); else AMX_BLOCK(1, 3, 7, 0);
                } else {
                    if (two) AMX_BLOCK(0, 2, 6, 1); else AMX_BLOCK(0, 2, 6, 0);
                }
            }
            amx_store(out, rows, b, colsums, c + r * ldc, ldc, n);
        }
    }
    _tile_release();
}
#endif /* AMX */
#endif /* ISA == 2 */

#if ISA == 1
/* Two rows of a16 (A as int16, row stride kp) times one block: 4 ymm accumulators per row, lane
 * 2q + h of accumulator v holding channel 4v + q's products of k = 4g + 2h and 4g + 2h + 1. */
static inline __attribute__((always_inline)) void tile2(const int MR, const int16_t *a16, int64_t kp,
                                                        const int8_t *wb, int32_t *c, int64_t ldc, int64_t col,
                                                        int64_t n) {
    __m256i acc[2][4];
    const int64_t groups = kp / GROUP;
    for (int i = 0; i < MR; i++)
        for (int v = 0; v < 4; v++) acc[i][v] = _mm256_setzero_si256();
    for (int64_t g = 0; g < groups; g++) {
        __m256i w[4];
        const int8_t *p = wb + g * (BLOCK * GROUP);
        for (int v = 0; v < 4; v++) w[v] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16 * v)));
        for (int i = 0; i < MR; i++) {
            int64_t a4;
            memcpy(&a4, a16 + i * kp + g * GROUP, sizeof a4);
            __m256i a = _mm256_set1_epi64x(a4);
            for (int v = 0; v < 4; v++) acc[i][v] = _mm256_add_epi32(acc[i][v], _mm256_madd_epi16(a, w[v]));
        }
    }
    for (int i = 0; i < MR; i++) {
        /* hadd pairs: lanes of hadd(x, y) = x01 x23 y01 y23 | x45 x67 y45 y67 -> channels 0 1 4 5 | 2 3 6 7 */
        __m256i lo = _mm256_hadd_epi32(acc[i][0], acc[i][1]), hi = _mm256_hadd_epi32(acc[i][2], acc[i][3]);
        const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
        lo = _mm256_permutevar8x32_epi32(lo, order);
        hi = _mm256_permutevar8x32_epi32(hi, order);
        int32_t out[BLOCK];
        _mm256_storeu_si256((__m256i *)out, lo);
        _mm256_storeu_si256((__m256i *)(out + 8), hi);
        int64_t count = n - col < BLOCK ? n - col : BLOCK;
        memcpy(c + i * ldc + col, out, (size_t)count * sizeof(int32_t));
    }
}

static void run_blocks(const int16_t *a16, int64_t m, int64_t kp, const int8_t *packed, int64_t n, int32_t *c,
                       int64_t ldc, int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; b++) {
        const int8_t *wb = packed + b * BLOCK * kp;
        int64_t i = 0;
        for (; i + 2 <= m; i += 2) tile2(2, a16 + i * kp, kp, wb, c + i * ldc, ldc, b * BLOCK, n);
        if (i < m) tile2(1, a16 + i * kp, kp, wb, c + i * ldc, ldc, b * BLOCK, n);
    }
}
#endif /* ISA == 1 */

#if ISA == 0
/* Portable: for each block and row, 16 int32 sums of signed products (|sum| <= 128 * 127 * K). */
static void run_blocks(const int8_t *a, int64_t m, int64_t k, int64_t lda, int64_t kp, const int8_t *packed,
                       int64_t n, int32_t *c, int64_t ldc, int64_t lo, int64_t hi) {
    const int64_t groups = kp / GROUP;
    for (int64_t b = lo; b < hi; b++) {
        const int8_t *wb = packed + b * BLOCK * kp;
        for (int64_t i = 0; i < m; i++) {
            int32_t acc[BLOCK] = {0};
            const int8_t *row = a + i * lda;
            for (int64_t g = 0; g < groups; g++)
                for (int64_t t = 0; t < GROUP; t++) {
                    int64_t kk = g * GROUP + t;
                    if (kk >= k) break;
                    int32_t x = row[kk];
                    const int8_t *p = wb + g * BLOCK * GROUP + t;
                    for (int j = 0; j < BLOCK; j++) acc[j] += x * (int32_t)p[j * GROUP];
                }
            for (int j = 0; j < BLOCK && b * BLOCK + j < n; j++) c[i * ldc + b * BLOCK + j] = acc[j];
        }
    }
}
#endif /* ISA == 0 */

/* The activations as each path reads them, rows [r0, r1) into buf (row stride kp): for AVX-512,
 * A + 128 as unsigned bytes (A xor 0x80); for AVX2, A as int16; the padding up to kp meets zero
 * weights, so its value does not matter (0x80 and 0 keep it the offset of zero). */
#if ISA == 2
typedef uint8_t act_t;
static void prepare(const int8_t *a, int64_t lda, int64_t r0, int64_t r1, int64_t k, int64_t kp, act_t *buf) {
    for (int64_t i = r0; i < r1; i++) {
        for (int64_t j = 0; j < k; j++) buf[i * kp + j] = (uint8_t)a[i * lda + j] ^ 0x80u;
        for (int64_t j = k; j < kp; j++) buf[i * kp + j] = 0x80u;
    }
}
#if AMX
/* Rows of a prepared buffer: the AMX tiles read whole tiles of 16 rows (the padding rows hold the
 * offset of zero, 0x80, and their sums are never stored). */
static inline int64_t buffer_rows(int64_t m, int64_t kp) { return amx_runs(m, kp) ? round_up(m, 16) : m; }
static inline void pad_rows(int64_t m, int64_t kp, act_t *buf) {
    memset(buf + m * kp, 0x80, (size_t)((buffer_rows(m, kp) - m) * kp));
}
#define RUN(lo, hi)                                                                \
    (amx_runs(m, kp) ? run_blocks_amx(buf, m, kp, packed, colsums, n, c, ldc, lo, hi) \
                     : run_blocks(buf, m, kp, packed, colsums, n, c, ldc, lo, hi, NULL))
#else
#define RUN(lo, hi) run_blocks(buf, m, kp, packed, colsums, n, c, ldc, lo, hi, NULL)
#endif
#elif ISA == 1
typedef int16_t act_t;
static void prepare(const int8_t *a, int64_t lda, int64_t r0, int64_t r1, int64_t k, int64_t kp, act_t *buf) {
    for (int64_t i = r0; i < r1; i++) {
        for (int64_t j = 0; j < k; j++) buf[i * kp + j] = a[i * lda + j];
        for (int64_t j = k; j < kp; j++) buf[i * kp + j] = 0;
    }
}
#define RUN(lo, hi) run_blocks(buf, m, kp, packed, n, c, ldc, lo, hi)
#else
#define RUN(lo, hi) run_blocks(a, m, k, lda, kp, packed, n, c, ldc, lo, hi)
#endif

#if ISA == 0
typedef int8_t act_t; /* unused: the portable path reads A itself */
#endif
#if !AMX
static inline int64_t buffer_rows(int64_t m, int64_t kp) { (void)kp; return m; }
static inline void pad_rows(int64_t m, int64_t kp, act_t *buf) { (void)m, (void)kp, (void)buf; }
#endif

/* One call's operands; share t of `shares` takes its part of the 16-channel blocks. */
struct gemm_job {
    const int8_t *a;
    int64_t m, k, lda, kp;
    const int8_t *packed;
    const int32_t *colsums;
    int64_t n;
    int32_t *c;
    int64_t ldc;
    int shares;
    int64_t nblocks;
    act_t *bufs;
};

static void gemm_share(void *context, int64_t t) {
    const struct gemm_job *job = context;
    const int8_t *a = job->a, *packed = job->packed;
    const int32_t *colsums = job->colsums;
    int64_t m = job->m, k = job->k, lda = job->lda, kp = job->kp, n = job->n, ldc = job->ldc, lo, hi;
    int32_t *c = job->c;
    (void)a, (void)k, (void)lda, (void)colsums;
#if ISA != 0
    act_t *buf = job->bufs + t * buffer_rows(m, kp) * kp;
    prepare(a, lda, 0, m, k, kp, buf);
    pad_rows(m, kp, buf);
#endif
    share(job->nblocks, job->shares, (int)t, &lo, &hi);
    RUN(lo, hi);
}

/* Below this many weight bytes a call runs on one thread: the fork and join cost more than the
 * second core saves (and the result is the same either way). */
#define SMALL_WEIGHT (64 * 1024)

/* C [m, n] int32 (row stride ldc) = A [m, k] int8 (row stride lda) times the packed weight's
 * transpose; up to `threads` threads of the kernels' pool (pool.h) split the output channels.
 * The result is the exact integer product whatever the path, the threads or the shapes.
 * Returns 0, or -1 when the activation buffers (m * k bytes per thread, two per element on AVX2)
 * could not be allocated (then c is untouched). */
int int8_gemm(const int8_t *a, int64_t m, int64_t k, int64_t lda, const int8_t *packed, const int32_t *colsums,
              int64_t n, int32_t *c, int64_t ldc, int threads) {
    if (m <= 0 || n <= 0) return 0;
    int64_t kp = round_up(k, GROUP), nblocks = round_up(n, BLOCK) / BLOCK;
    if (kp <= 0) { /* an empty sum */
        for (int64_t i = 0; i < m; i++) memset(c + i * ldc, 0, (size_t)n * sizeof(int32_t));
        return 0;
    }
    if (threads < 1 || nblocks * BLOCK * kp < SMALL_WEIGHT) threads = 1;
    if (threads > nblocks) threads = (int)nblocks;
#if ISA != 2
    (void)colsums; /* the signed paths need no offset correction */
#endif
    struct gemm_job job = {a, m, k, lda, kp, packed, colsums, n, c, ldc, threads, nblocks, NULL};
#if ISA != 0
    /* One copy of the prepared rows per share: each prepares all of them itself (m * k bytes,
     * cheap) and reads them from its own core's cache, rather than sharing one copy that the other
     * core would then fetch line by line. */
    job.bufs = malloc((size_t)(threads * buffer_rows(m, kp) * kp) * sizeof(act_t));
    if (job.bufs == NULL) return -1;
#endif
    pool_for(threads, threads, gemm_share, &job);
#if ISA != 0
    free(job.bufs);
#endif
    return 0;
}

/* Each channel's weight sum over each EXP_BLOCK of k, from the packed form: out [chunks][npad]
 * int32 (chunks = kp / EXP_BLOCK rounded up, npad = n rounded up to 16), what the block kernel
 * takes off each block's sums (|sum| <= 127 * 64). */
void int8_gemm_chunk_sums(const int8_t *packed, int64_t n, int64_t k, int32_t *out) {
    int64_t kp = round_up(k, GROUP), groups = kp / GROUP, npad = round_up(n, BLOCK);
    int64_t chunks = (kp + EXP_BLOCK - 1) / EXP_BLOCK;
    memset(out, 0, sizeof(int32_t) * (size_t)(chunks * npad));
    for (int64_t b = 0; b < npad / BLOCK; b++)
        for (int64_t g = 0; g < groups; g++)
            for (int64_t j = 0; j < BLOCK; j++) {
                const int8_t *v = packed + b * BLOCK * kp + (g * BLOCK + j) * GROUP;
                out[(g * GROUP / EXP_BLOCK) * npad + b * BLOCK + j] += v[0] + v[1] + v[2] + v[3];
            }
}

/* The whole int8 linear layer of kernels/int8_linear.py in one call (one job of the pool instead
 * of three, no int32 [2m, n] tensor): out [m, n] float32 = x [m, k] (row stride ldx) times the
 * weight's transpose, each row quantized (int8_rows.c's quantize_one), the exact integer sums
 * combined with the scales (+ bias) by int8_rows.c's own per-row functions, so the same bits as
 * the three calls. The sums come from the two halves' rows, or, on the AVX-512 path with
 * `chunk_sums` (int8_gemm_chunk_sums; NULL: the halves), from one row of block mantissas each
 * (the block kernel above): the same integers, so the same bits, from half the multiply-adds.
 * Each share computes its channels in chunks of LINEAR_CHUNK blocks into a tile of its own and
 * combines them at once. Returns 0, or -1 when the buffers could not be allocated. */
#define LINEAR_CHUNK 16

struct linear_job {
    struct gemm_job gemm;   /* over the 2m halves (hi rows, then lo rows), or the m mantissa rows */
    const float *row_scales, *weight_scales, *bias;
    float *out;
    int32_t *tiles;         /* per share: [2m][LINEAR_CHUNK * 16]: hi, lo sums (or c, low sums) */
    const uint8_t *exps;    /* the block path: [m][chunks] exponents; NULL: the halves */
    const int32_t *chunk_sums;
};

static void linear_share(void *context, int64_t t) {
    const struct linear_job *job = context;
    const struct gemm_job *g = &job->gemm;
    const int8_t *a = g->a, *packed = g->packed;
    const int32_t *colsums = g->colsums;
    int64_t m = g->m, k = g->k, lda = g->lda, kp = g->kp, n = g->n, lo, hi;
    int64_t rows = job->exps ? m : m / 2, ldc = LINEAR_CHUNK * BLOCK;
    int32_t *tile = job->tiles + t * 2 * rows * ldc;
    int64_t unit = HALF;
    (void)a, (void)k, (void)lda, (void)colsums;
#if ISA != 0
    act_t *buf = g->bufs + t * buffer_rows(m, kp) * kp;
    prepare(a, lda, 0, m, k, kp, buf);
    pad_rows(m, kp, buf);
#endif
    share(g->nblocks, g->shares, (int)t, &lo, &hi);
    for (int64_t b0 = lo; b0 < hi; b0 += LINEAR_CHUNK) {
        int64_t b1 = b0 + LINEAR_CHUNK < hi ? b0 + LINEAR_CHUNK : hi;
        int32_t *c = tile - b0 * BLOCK; /* column b * 16 of the chunk lands at tile + (b - b0) * 16 */
#if ISA == 2
        if (job->exps) {
            block_sums bs = {job->exps, (kp + EXP_BLOCK - 1) / EXP_BLOCK, job->chunk_sums, c + rows * ldc};
            run_blocks(buf, m, kp, packed, colsums, n, c, ldc, b0, b1, &bs);
            unit = CHUNK_UNIT;
        } else
#endif
        {
            RUN(b0, b1);
        }
        int64_t from = b0 * BLOCK, to = b1 * BLOCK < n ? b1 * BLOCK : n;
        for (int64_t i = 0; i < rows; i++)
            combine_span(c + i * ldc, c + (rows + i) * ldc, unit, from, to, job->row_scales[i], job->weight_scales,
                         job->bias, job->out + i * n);
    }
}

/* Whether a linear of m rows over k runs on the block kernel (given its chunk sums): the AVX-512
 * VNNI path at k <= BLOCK_MAX_K in whole exponent blocks, from BLOCK_MIN_ROWS rows (below, the
 * weights' streaming costs the same for twice the rows, and a block's flush is overhead), unless
 * the halves would run on AMX tiles. Speed only: both compute the same integers. */
#define BLOCK_MIN_ROWS 4
static int block_kernel_runs(int64_t m, int64_t kp) {
#if ISA == 2
#if AMX
    if (amx_runs(2 * m, kp)) return 0;
#endif
    return m >= BLOCK_MIN_ROWS && kp <= BLOCK_MAX_K;
#else
    (void)m, (void)kp;
    return 0;
#endif
}

/* Whether int8_linear runs the block kernel for m rows over k (given the weight's chunk sums). */
int int8_linear_blocks(int64_t m, int64_t k) { return k > 0 && block_kernel_runs(m, round_up(k, GROUP)); }

int int8_linear(const float *x, int64_t m, int64_t k, int64_t ldx, const int8_t *packed, const int32_t *colsums,
                const int32_t *chunk_sums, int64_t n, const float *weight_scales, const float *bias, float *out,
                int threads) {
    if (m <= 0 || n <= 0) return 0;
    int64_t kp = round_up(k, GROUP), nblocks = round_up(n, BLOCK) / BLOCK, halves = 2 * m;
    int64_t chunks = (kp + EXP_BLOCK - 1) / EXP_BLOCK;
    int blocked = chunk_sums != NULL && k > 0 && block_kernel_runs(m, kp);
    int64_t gemm_rows = blocked ? m : halves;
    if (threads < 1 || nblocks * BLOCK * kp < SMALL_WEIGHT) threads = 1;
    if (threads > nblocks) threads = (int)nblocks;
    int8_t *a = blocked ? NULL : malloc((size_t)(halves * (k > 0 ? k : 1))); /* the halves, where they run */
    int8_t *mantissas = blocked ? malloc((size_t)(m * k)) : NULL;
    uint8_t *exps = blocked ? malloc((size_t)(m * chunks)) : NULL;
    float *row_scales = malloc(sizeof(float) * (size_t)m);
    /* 64-byte aligned: the block kernel adds whole vectors into these sums every block of k */
    int32_t *tiles = aligned_alloc(64, sizeof(int32_t) * (size_t)(threads * halves * LINEAR_CHUNK * BLOCK));
    act_t *bufs = ISA != 0 ? malloc((size_t)(threads * buffer_rows(gemm_rows, kp) * kp) * sizeof(act_t)) : NULL;
    int failed = !row_scales || !tiles || (ISA != 0 && !bufs) || (blocked ? !mantissas || !exps : !a);
    if (!failed) {
        for (int64_t i = 0; i < m; i++)
            row_scales[i] = blocked ? quantize_one(x + i * ldx, k, NULL, NULL, mantissas + i * k, exps + i * chunks)
                                    : quantize_one(x + i * ldx, k, a + i * k, a + (m + i) * k, NULL, NULL);
        struct linear_job job = {{blocked ? mantissas : a, gemm_rows, k, k, kp, packed, colsums, n, NULL,
                                  LINEAR_CHUNK * BLOCK, threads, nblocks, bufs},
                                 row_scales, weight_scales, bias, out, tiles, exps, chunk_sums};
        pool_for(threads, threads, linear_share, &job);
    }
    free(a);
    free(mantissas);
    free(exps);
    free(row_scales);
    free(tiles);
    free(bufs);
    return failed ? -1 : 0;
}
