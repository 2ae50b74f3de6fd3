// decode-span: an LD_PRELOAD shim for upstream's llama.cpp tools (built with shared libraries),
// used by scripts/gpu-check. It times the tool's decode loop from inside the process, so the
// check can compare collection with a plain forward pass without what each process also pays
// (starting the backend, loading the model onto the device, writing files), which on a GPU can
// outweigh the decodes.
//
// It wraps llama_process (the pin's decode entry point) and notes when each DECODE call
// returns; common's warm-up decode is forgotten at llama_perf_context_reset, which ends the
// warm-up. At exit it prints, on stderr, the line our binary prints for its own decodes:
//     decode-span: N decodes, S s from the end of the first to the end of the last
// S / (N - 1) is then the time of each decode after the first, host work between decodes
// included (the perplexity's log-softmax, the imatrix's periodic saves), the first decode's
// one-time costs (lazily loaded kernels, first touches) left out.
//
//   cc -O2 -shared -fPIC -I TREE/include -I TREE/ggml/include -o decode-span.so decode-span.c -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "llama.h"

static long long n_decodes;
static double first_end, last_end;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double) t.tv_sec + 1e-9 * (double) t.tv_nsec;
}

int32_t llama_process(struct llama_context * ctx, enum llama_process_type type, struct llama_batch_ext * batch) {
    static int32_t (*real)(struct llama_context *, enum llama_process_type, struct llama_batch_ext *);
    if (!real) {
        real = (int32_t (*)(struct llama_context *, enum llama_process_type, struct llama_batch_ext *)) dlsym(RTLD_NEXT, "llama_process");
        if (!real) {
            fprintf(stderr, "decode-span: llama_process not found: %s\n", dlerror());
            abort();
        }
    }
    const int32_t rc = real(ctx, type, batch);
    if (type == LLAMA_PROCESS_TYPE_DECODE && rc == 0) {
        last_end = now();
        if (n_decodes++ == 0) {
            first_end = last_end;
        }
    }
    return rc;
}

void llama_perf_context_reset(struct llama_context * ctx) {
    static void (*real)(struct llama_context *);
    if (!real) {
        real = (void (*)(struct llama_context *)) dlsym(RTLD_NEXT, "llama_perf_context_reset");
    }
    if (real) {
        real(ctx);
    }
    // the warm-up is over: only the decodes after it count
    n_decodes = 0;
}

__attribute__((destructor)) static void report(void) {
    if (n_decodes > 0) {
        fprintf(stderr, "decode-span: %lld decodes, %.6f s from the end of the first to the end of the last\n", n_decodes, last_end - first_end);
    }
}
