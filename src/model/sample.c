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
#include <string.h>

#include "detmath.h"
#include "model_internal.h"

static uint32_t argmax_first(const float *v, uint32_t n) {
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}

/* In-place heapsort, ascending. (Not qsort: glibc's may allocate a merge
 * buffer, and nothing on the per-token path allocates.) The keys are unique,
 * so any correct sort gives the same order. */
static void sift_down(uint64_t *v, size_t root, size_t n) {
    for (;;) {
        size_t child = 2 * root + 1;
        if (child >= n) return;
        if (child + 1 < n && v[child + 1] > v[child]) child++;
        if (v[root] >= v[child]) return;
        uint64_t t = v[root];
        v[root] = v[child];
        v[child] = t;
        root = child;
    }
}

static void heapsort_u64(uint64_t *v, size_t n) {
    for (size_t i = n / 2; i-- > 0;) sift_down(v, i, n);
    for (size_t end = n; end > 1; end--) {
        uint64_t t = v[0];
        v[0] = v[end - 1];
        v[end - 1] = t;
        sift_down(v, 0, end - 1);
    }
}

/* Sort key: descending probability, then ascending index. Probabilities are
 * non-negative floats, whose bit patterns order like the values. */
static uint64_t key_of(float p, uint32_t index) {
    uint32_t bits;
    memcpy(&bits, &p, sizeof(bits));
    return ((uint64_t)(UINT32_MAX - bits) << 32) | index;
}

void mdl_sample(const float *logits, uint32_t vocab, const pd_sampling *sp, uint32_t sample_index,
                float *probs, uint64_t *keys, int32_t *token, float *logprob) {
    PD_ASSERT(vocab > 0);
    const uint32_t best = argmax_first(logits, vocab);
    const double max = logits[best];
    double z = 0.0;
    for (uint32_t i = 0; i < vocab; i++) z += mdl_exp((double)logits[i] - max);
    const double log_z = max + mdl_log(z);

    uint32_t chosen = best;
    if (sp->temperature > 0.0f) {
        const double inv_t = 1.0 / (double)sp->temperature;
        double zt = 0.0;
        for (uint32_t i = 0; i < vocab; i++) zt += mdl_exp(((double)logits[i] - max) * inv_t);
        for (uint32_t i = 0; i < vocab; i++)
            probs[i] = (float)(mdl_exp(((double)logits[i] - max) * inv_t) / zt);

        pd_rng rng;
        pd_rng_seed(&rng, pd_hash_u64(sp->seed) ^ pd_hash_u64(0x5eed0000ull + sample_index));
        const double u = pd_rng_unit(&rng);
        /* Candidates in visiting order: every token by index, or the top_p
         * nucleus by decreasing probability. */
        uint32_t kept = vocab;
        bool sorted = sp->top_p < 1.0f;
        if (sorted) {
            for (uint32_t i = 0; i < vocab; i++) keys[i] = key_of(probs[i], i);
            heapsort_u64(keys, vocab);
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
