/*
 * binding_tests.c - attention_c._core_tests, the tests' copy of the
 * binding: binding.c with ATT_TEST_HOOKS, which adds the allocation-point
 * counter and fault injection (_fail_alloc_after, _alloc_count,
 * _alloc_trace) and the vector tanh entry (_tanh).  The production
 * extension attention_c._core is binding.c without them.  Its own file (not
 * a -D on binding.c) so that the two objects do not share a path in the
 * build tree.
 */
#define ATT_TEST_HOOKS 1
#include "binding.c"
