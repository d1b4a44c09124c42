/* What every AMX path here shares (int8_gemm.c, block_gemm.c, lane_attention.c): the tile state,
 * which Linux grants a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM, asked once per
 * library; a kernel without AMX support refuses, and the caller keeps its vector path), and the
 * tile configuration record `_tile_loadconfig` reads. Include it only in a Linux build with AMX.
 * AGENTFOLD_AMX=0 in the environment keeps the process off the tiles as if refused: every path
 * then runs as on a CPU without AMX (the benchmark's measure of one; `attention_kernel` names the
 * difference, so snapshots of the two never mix). */
#ifndef AGENTFOLD_AMX_TILES_H
#define AGENTFOLD_AMX_TILES_H

#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ARCH_REQ_XCOMP_PERM 0x1023
#define AMX_XFEATURE_XTILEDATA 18

static int amx_granted;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static void amx_request(void) {
    const char *wanted = getenv("AGENTFOLD_AMX");
    if (wanted && strcmp(wanted, "0") == 0) return;
    amx_granted = syscall(SYS_arch_prctl, AMX_ARCH_REQ_XCOMP_PERM, AMX_XFEATURE_XTILEDATA) == 0;
}

/* Whether this process may use the tiles (asked once). */
static inline int amx_usable(void) {
    pthread_once(&amx_once, amx_request);
    return amx_granted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} amx_config;

/* Tiles 0..7 all 16 rows x 64 bytes (int8_gemm.c, lane_attention.c; block_gemm.c's legacy types
 * configure narrower A and B tiles of their own). */
static inline void amx_configure_16x64(void) {
    amx_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

#endif
