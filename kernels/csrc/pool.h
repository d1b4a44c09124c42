/* The one thread pool of the CPU kernels (csrc/pool.c): every kernel of the library shares it.
 *
 * Why not OpenMP: a pass calls ~150 kernels a few microseconds apart, and waking a sleeping
 * worker for each costs tens of microseconds. libgomp's workers spin a while first, but only
 * while the process's OpenMP threads number no more than its cores: once a second thread has
 * started a parallel region (the model loaded on one thread, passes run on the runtime's), every
 * wait turns into a sleep, and a 1-row SmolLM2 pass on two cores went from 17 to 35 ms. This pool
 * belongs to the kernels alone: its workers spin for a millisecond after each job, then sleep.
 *
 * Which thread runs a task never changes a bit: every kernel computes each of its outputs inside
 * one task, in an order fixed by the task alone.
 */
#ifndef AGENTFOLD_POOL_H
#define AGENTFOLD_POOL_H

#include <stdint.h>

typedef void (*pool_task)(void *context, int64_t index);

/* task(context, i) for every i in 0..count-1, on up to `threads` threads (the caller is one of
 * them), each task handed to the next free thread; returns once all have run. Callers from
 * several threads take turns; a task must not call pool_for itself. */
void pool_for(int threads, int64_t count, pool_task task, void *context);

/* Whether jobs currently run on the caller alone: a recent job found the machine busy (pool.c). */
int pool_alone(void);

#endif
