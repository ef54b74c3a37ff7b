/*
 * sample.c — choosing the next token from the logits.
 *
 * In order:
 *   1. Penalties, on a copy of the logits, for the tokens the request has
 *      generated so far (the history; the prompt is not looked at):
 *      repetition_penalty divides a positive logit and multiplies a negative
 *      one, once per distinct token; then frequency_penalty times the
 *      token's count and presence_penalty are subtracted. Each token's
 *      adjustment is computed in double from its count, so the order of the
 *      history does not matter.
 *   2. Greedy (temperature 0) takes the first index among equal maxima of
 *      the (penalised) logits, so ties resolve the same way everywhere.
 *   3. Otherwise the distribution is softmax(logits / temperature). When a
 *      filter is on, the tokens are sorted by decreasing probability (ties:
 *      lower index first) and three cuts are taken on that order, each on
 *      the unfiltered probabilities: top_k keeps the first k; top_p keeps a
 *      token while the mass before it is below top_p; min_p keeps tokens
 *      whose probability is at least min_p times the first's. The kept set
 *      is the shortest of the three prefixes (never empty).
 *   4. One token is drawn with a generator seeded by (sampling.seed,
 *      sample_index): the k-th output token of a request is drawn from its
 *      own stream, so it does not depend on which batch, node or step
 *      computed it.
 *
 * All sums run sequentially in double in index (or sorted) order. The
 * reported logprob is log-softmax of the raw logits at the chosen token, and
 * the top_logprobs alternatives are the raw distribution's most likely
 * tokens: the model's belief, independent of the sampling settings.
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

/* Step 1: the penalised logits in adj (a copy of logits). keys is scratch:
 * it holds each history token's count while the adjustments are made, and
 * is left with zeros there. */
static void penalize(const float *logits, uint32_t vocab, const pd_sampling *sp,
                     const int32_t *history, uint32_t n_history, float *adj, uint64_t *keys) {
    memcpy(adj, logits, sizeof(float) * vocab);
    for (uint32_t i = 0; i < n_history; i++) keys[history[i]] = 0;
    for (uint32_t i = 0; i < n_history; i++) keys[history[i]]++;
    const bool rep = sp->repetition_penalty != 0.0f && sp->repetition_penalty != 1.0f;
    for (uint32_t i = 0; i < n_history; i++) {
        const int32_t t = history[i];
        if (keys[t] == 0) continue; /* done at its first occurrence */
        double x = adj[t];
        if (rep) x = x > 0.0 ? x / sp->repetition_penalty : x * sp->repetition_penalty;
        x -= (double)sp->frequency_penalty * (double)keys[t] + (double)sp->presence_penalty;
        adj[t] = (float)x;
        keys[t] = 0;
    }
}

/* The n most likely tokens of the raw logits, most likely first (ties:
 * lower index), with their log-softmax. */
static void top_logprobs(const float *logits, uint32_t vocab, double log_z, uint32_t n,
                         pd_item_result *out, pd_item_top *top) {
    if (n > PD_TOP_LOGPROBS_MAX) n = PD_TOP_LOGPROBS_MAX;
    if (n > vocab) n = vocab;
    uint32_t have = 0;
    for (uint32_t i = 0; i < vocab; i++) {
        /* Insert i if it beats the last kept one (strictly: an equal logit
         * at a higher index ranks after). */
        if (have == n && !(logits[i] > logits[top->token[have - 1]])) continue;
        uint32_t at = have < n ? have++ : n - 1;
        while (at > 0 && logits[i] > logits[top->token[at - 1]]) {
            top->token[at] = top->token[at - 1];
            at--;
        }
        top->token[at] = (int32_t)i;
    }
    for (uint32_t r = 0; r < have; r++)
        top->logprob[r] = (float)((double)logits[top->token[r]] - log_z);
    out->n_top = have;
}

/* Step 3's cuts: how many of the sorted candidates stay (at least one). */
static uint32_t kept_count(const pd_sampling *sp, const float *probs, const uint64_t *keys,
                           uint32_t vocab) {
    uint32_t kept = sp->top_k > 0 && sp->top_k < vocab ? sp->top_k : vocab;
    if (sp->top_p < 1.0f) {
        double before = 0.0;
        uint32_t k = 0;
        while (k < kept && before < (double)sp->top_p) before += probs[(uint32_t)keys[k++]];
        kept = k;
    }
    if (sp->min_p > 0.0f) {
        const double floor_p = (double)sp->min_p * probs[(uint32_t)keys[0]];
        uint32_t k = 1;
        while (k < kept && (double)probs[(uint32_t)keys[k]] >= floor_p) k++;
        kept = k;
    }
    return kept > 0 ? kept : 1;
}

void mdl_sample(const float *logits, uint32_t vocab, const pd_sampling *sp, uint32_t sample_index,
                const int32_t *history, float *probs, uint64_t *keys, pd_item_result *out,
                pd_item_top *top) {
    PD_ASSERT(vocab > 0);
    const uint32_t raw_best = argmax_first(logits, vocab);
    const double raw_max = logits[raw_best];
    double z = 0.0;
    for (uint32_t i = 0; i < vocab; i++) z += mdl_exp((double)logits[i] - raw_max);
    const double log_z = raw_max + mdl_log(z);

    /* The logits the choice is made from: the raw ones, or the penalised
     * copy (in probs, which step 3 then turns into probabilities in place). */
    const float *lg = logits;
    if (history && sample_index > 0 && pd_sampling_penalized(sp)) {
        penalize(logits, vocab, sp, history, sample_index, probs, keys);
        lg = probs;
    }
    const uint32_t best = lg == logits ? raw_best : argmax_first(lg, vocab);
    const double max = lg[best];

    uint32_t chosen = best;
    if (sp->temperature > 0.0f) {
        const double inv_t = 1.0 / (double)sp->temperature;
        double zt = 0.0;
        for (uint32_t i = 0; i < vocab; i++) zt += mdl_exp(((double)lg[i] - max) * inv_t);
        for (uint32_t i = 0; i < vocab; i++)
            probs[i] = (float)(mdl_exp(((double)lg[i] - max) * inv_t) / zt);

        pd_rng rng;
        pd_rng_seed(&rng, pd_hash_u64(sp->seed) ^ pd_hash_u64(0x5eed0000ull + sample_index));
        const double u = pd_rng_unit(&rng);
        /* Candidates in visiting order: every token by index, or the kept
         * prefix of the tokens sorted by decreasing probability. */
        uint32_t kept = vocab;
        bool sorted = sp->top_p < 1.0f || (sp->top_k > 0 && sp->top_k < vocab) || sp->min_p > 0.0f;
        if (sorted) {
            for (uint32_t i = 0; i < vocab; i++) keys[i] = key_of(probs[i], i);
            heapsort_u64(keys, vocab);
            kept = kept_count(sp, probs, keys, vocab);
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
    out->token = (int32_t)chosen;
    out->logprob = (float)((double)logits[chosen] - log_z);
    out->n_top = 0;
    if (sp->top_logprobs && top) top_logprobs(logits, vocab, log_z, sp->top_logprobs, out, top);
}
