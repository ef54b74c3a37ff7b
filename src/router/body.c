/* The router's checks of a client's body; body.h says what and why. */
#include "body.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "pdserve/base.h"

typedef enum kind { K_STRING, K_BOOL, K_INTEGER, K_NUMBER, K_ARRAY, K_OBJECT, K_PROMPT } kind;

static bool has_kind(json_t *v, kind k) {
    switch (k) {
    case K_STRING: return json_is_string(v);
    case K_BOOL: return json_is_boolean(v);
    case K_INTEGER: return json_is_integer(v);
    case K_NUMBER: return json_is_number(v);
    case K_ARRAY: return json_is_array(v);
    case K_OBJECT: return json_is_object(v);
    case K_PROMPT: return json_is_string(v) || json_is_array(v);
    }
    return false;
}

static const char *kind_name(kind k) {
    static const char *names[] = {"a string",
                                  "a boolean",
                                  "an integer",
                                  "a number",
                                  "an array",
                                  "an object",
                                  "a string or an array of token ids"};
    return names[k];
}

typedef struct field_rule {
    const char *name;
    kind kind;
} field_rule;

static const field_rule generate_rules[] = {
    {"text", K_PROMPT}, {"input_ids", K_ARRAY}, {"sampling_params", K_OBJECT},
    {"stream", K_BOOL}, {"rid", K_STRING},
};
static const field_rule sampling_rules[] = {
    {"max_new_tokens", K_INTEGER}, {"temperature", K_NUMBER}, {"top_p", K_NUMBER},
    {"stop_token_ids", K_ARRAY},   {"ignore_eos", K_BOOL},
};
static const field_rule chat_rules[] = {
    {"model", K_STRING},         {"messages", K_ARRAY},
    {"max_tokens", K_INTEGER},   {"max_completion_tokens", K_INTEGER},
    {"temperature", K_NUMBER},   {"top_p", K_NUMBER},
    {"stream", K_BOOL},          {"stream_options", K_OBJECT},
    {"stop_token_ids", K_ARRAY}, {"ignore_eos", K_BOOL},
    {"rid", K_STRING},
};
static const field_rule completions_rules[] = {
    {"model", K_STRING},         {"prompt", K_PROMPT},   {"max_tokens", K_INTEGER},
    {"temperature", K_NUMBER},   {"top_p", K_NUMBER},    {"stream", K_BOOL},
    {"stop_token_ids", K_ARRAY}, {"ignore_eos", K_BOOL}, {"rid", K_STRING},
};

/* A client-supplied rid must be one the nodes accept (PD_RID_MAX, base.h):
 * the router refuses the rest at the door rather than forward a request
 * that both halves would refuse. An embedded NUL would reach the nodes as a
 * different, shorter rid, so it is refused too. */
#define RID_RULE "rid must be a non-empty string of at most %d bytes, without NUL"

static bool rid_acceptable(json_t *rid) {
    if (!json_is_string(rid)) return false;
    size_t n = json_string_length(rid);
    return n > 0 && n < PD_RID_MAX && strlen(json_string_value(rid)) == n;
}

/* The fields the router knows must have their type; the rest is the
 * workers' to judge (unknown fields are ignored, as the API says). Returns
 * false with the message naming the field. */
static bool check_fields(json_t *o, const field_rule *rules, size_t n, const char *prefix,
                         char *why, size_t cap) {
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_object_get(o, rules[i].name);
        if (v && !has_kind(v, rules[i].kind)) {
            snprintf(why, cap, "%s%s must be %s", prefix, rules[i].name, kind_name(rules[i].kind));
            return false;
        }
    }
    return true;
}

static bool validate_generation(rt_body_kind what, json_t *o, char *why, size_t cap) {
    if (what == RT_BODY_GENERATE) {
        if (!check_fields(o, generate_rules, PD_ARRAY_LEN(generate_rules), "", why, cap))
            return false;
        json_t *sp = json_object_get(o, "sampling_params");
        if (sp &&
            !check_fields(sp, sampling_rules, PD_ARRAY_LEN(sampling_rules), "sampling_params.", why,
                          cap))
            return false;
    } else if (what == RT_BODY_CHAT) {
        if (!check_fields(o, chat_rules, PD_ARRAY_LEN(chat_rules), "", why, cap)) return false;
        if (!json_object_get(o, "messages")) {
            snprintf(why, cap, "'messages' is required");
            return false;
        }
    } else if (!check_fields(o, completions_rules, PD_ARRAY_LEN(completions_rules), "", why, cap)) {
        return false;
    }
    json_t *rid = json_object_get(o, "rid");
    if (rid && !rid_acceptable(rid)) {
        snprintf(why, cap, RID_RULE, PD_RID_MAX - 1);
        return false;
    }
    return true;
}

static bool validate_abort(json_t *o, char *why, size_t cap) {
    json_t *rid = json_object_get(o, "rid");
    json_t *all = json_object_get(o, "abort_all");
    if (rid && !rid_acceptable(rid)) {
        snprintf(why, cap, RID_RULE, PD_RID_MAX - 1);
        return false;
    }
    if (all && !json_is_boolean(all)) {
        snprintf(why, cap, "abort_all must be a boolean");
        return false;
    }
    if (!json_is_true(all) && !rid) {
        snprintf(why, cap, "expected {\"rid\": \"...\"} or {\"abort_all\": true}");
        return false;
    }
    return true;
}

unsigned rt_body_parse(rt_body_kind what, const char *body, size_t len, json_t **out, char *why,
                       size_t cap) {
    *out = NULL;
    json_error_t jerr;
    json_t *o = json_loadb(body ? body : "", len, 0, &jerr);
    if (!o) {
        snprintf(why, cap, "malformed JSON: %s (line %d, column %d)", jerr.text, jerr.line,
                 jerr.column);
        return 400;
    }
    bool ok = json_is_object(o);
    if (!ok) snprintf(why, cap, "the body must be a JSON object");
    else if (what == RT_BODY_ABORT) ok = validate_abort(o, why, cap);
    else ok = validate_generation(what, o, why, cap);
    if (!ok) {
        json_decref(o);
        return 400;
    }
    *out = o;
    return 0;
}
