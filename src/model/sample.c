/*
 * sample.c — choosing the next token from the logits.
 *
 * Greedy (temperature 0) takes the first index among equal maxima, so ties
 * resolve the same way everywhere. Otherwise the distribution is
 * softmax(logits / temperature), cut to the smallest set of most likely
 * tokens whose probability reaches top_p (ties in probability broken by the
 * lower index), and one token is drawn with a generator seeded by
 * (sampling.seed, sample_index): the k-th output token of a request is drawn
 * from its own stream, so it does not depend on which batch, node or step
 * computed it.
 *
 * All sums run sequentially in double in index (or sorted) order. The
 * reported logprob is log-softmax of the raw logits at the chosen token: the
 * model's belief, independent of the sampling settings.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model_internal.h"

static uint32_t argmax_first(const float *v, uint32_t n) {
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Sort key: descending probability, then ascending index. Probabilities are
 * non-negative floats, whose bit patterns order like the values. */
static uint64_t key_of(float p, uint32_t index) {
    uint32_t bits;
    memcpy(&bits, &p, sizeof(bits));
    return ((uint64_t)(UINT32_MAX - bits) << 32) | index;
}

void pd_sample(const float *logits, uint32_t vocab, const pd_sampling *sp, uint32_t sample_index,
               float *probs, uint64_t *keys, int32_t *token, float *logprob) {
    PD_ASSERT(vocab > 0);
    const uint32_t best = argmax_first(logits, vocab);
    const double max = logits[best];
    double z = 0.0;
    for (uint32_t i = 0; i < vocab; i++) z += exp((double)logits[i] - max);
    const double log_z = max + log(z);

    uint32_t chosen = best;
    if (sp->temperature > 0.0f) {
        const double inv_t = 1.0 / (double)sp->temperature;
        double zt = 0.0;
        for (uint32_t i = 0; i < vocab; i++) zt += exp(((double)logits[i] - max) * inv_t);
        for (uint32_t i = 0; i < vocab; i++)
            probs[i] = (float)(exp(((double)logits[i] - max) * inv_t) / zt);

        pd_rng rng;
        pd_rng_seed(&rng, pd_hash_u64(sp->seed) ^ pd_hash_u64(0x5eed0000ull + sample_index));
        const double u = pd_rng_unit(&rng);
        /* Candidates in visiting order: every token by index, or the top_p
         * nucleus by decreasing probability. */
        uint32_t kept = vocab;
        bool sorted = sp->top_p < 1.0f;
        if (sorted) {
            for (uint32_t i = 0; i < vocab; i++) keys[i] = key_of(probs[i], i);
            qsort(keys, vocab, sizeof(uint64_t), cmp_u64);
            double nucleus = 0.0;
            kept = 0;
            while (kept < vocab && nucleus < (double)sp->top_p)
                nucleus += probs[(uint32_t)keys[kept++]];
        }
        double mass = 0.0;
        for (uint32_t r = 0; r < kept; r++) mass += probs[sorted ? (uint32_t)keys[r] : r];
        /* The draw lands in the candidate whose cumulative range holds it;
         * rounding at the very top falls back to the last likely one. */
        const double target = u * mass;
        double acc = 0.0;
        bool found = false;
        for (uint32_t r = 0; r < kept && !found; r++) {
            uint32_t i = sorted ? (uint32_t)keys[r] : r;
            if (probs[i] <= 0.0f) continue;
            acc += probs[i];
            chosen = i;
            found = target < acc;
        }
    }
    *token = (int32_t)chosen;
    *logprob = (float)((double)logits[chosen] - log_z);
}
