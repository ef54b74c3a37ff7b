/*
 * pd_list — the one intrusive list of the code base: doubly linked, by
 * index. The records live in the caller's array; each record that can be on
 * a list embeds a pd_link (one per list it can be on at the same time), and
 * the list itself is a head, a tail and a length. Nothing is allocated, so
 * pushing and removing can never fail; an index, unlike a pointer, survives
 * the array being copied and is a quarter of the size.
 *
 * A list names its records through a pd_links: where the array starts, the
 * size of a record and the offset of the pd_link inside it. A record is on
 * at most one list per pd_link; removing one that is not on the list is
 * asserted.
 */
#ifndef PDSERVE_LIST_H
#define PDSERVE_LIST_H

#include "pdserve/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_link {
    uint32_t prev, next; /* PD_NONE at the ends */
} pd_link;

typedef struct pd_list {
    uint32_t head, tail, len;
} pd_list;

typedef struct pd_links {
    void *base;     /* the record array */
    size_t stride;  /* sizeof one record */
    size_t offset;  /* offsetof(record, link) */
} pd_links;

#define PD_LINKS(array, type, member) \
    ((pd_links){.base = (array), .stride = sizeof(type), .offset = offsetof(type, member)})

static inline pd_link *pd_link_at(pd_links ls, uint32_t i) {
    return (pd_link *)((char *)ls.base + (size_t)i * ls.stride + ls.offset);
}

static inline void pd_list_init(pd_list *l) {
    l->head = l->tail = PD_NONE;
    l->len = 0;
}

static inline void pd_link_init(pd_link *k) { k->prev = k->next = PD_NONE; }

/* Inserts i after record `after` (PD_NONE: at the front). */
static inline void pd_list_insert_after(pd_list *l, pd_links ls, uint32_t after, uint32_t i) {
    pd_link *k = pd_link_at(ls, i);
    k->prev = after;
    k->next = after == PD_NONE ? l->head : pd_link_at(ls, after)->next;
    if (k->next != PD_NONE) pd_link_at(ls, k->next)->prev = i;
    else l->tail = i;
    if (after != PD_NONE) pd_link_at(ls, after)->next = i;
    else l->head = i;
    l->len++;
}

static inline void pd_list_push_back(pd_list *l, pd_links ls, uint32_t i) {
    pd_list_insert_after(l, ls, l->tail, i);
}

static inline void pd_list_push_front(pd_list *l, pd_links ls, uint32_t i) {
    pd_list_insert_after(l, ls, PD_NONE, i);
}

static inline void pd_list_remove(pd_list *l, pd_links ls, uint32_t i) {
    pd_link *k = pd_link_at(ls, i);
    PD_ASSERT(l->len > 0);
    PD_ASSERT(k->prev != PD_NONE ? pd_link_at(ls, k->prev)->next == i : l->head == i);
    if (k->prev != PD_NONE) pd_link_at(ls, k->prev)->next = k->next;
    else l->head = k->next;
    if (k->next != PD_NONE) pd_link_at(ls, k->next)->prev = k->prev;
    else l->tail = k->prev;
    k->prev = k->next = PD_NONE;
    l->len--;
}

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_LIST_H */
