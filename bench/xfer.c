#include <stdio.h>
int main(void) { puts("summary: stub"); return 0; }
