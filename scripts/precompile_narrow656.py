import sys
from flashdsa.sparse import kernel_fwd_narrow656 as m
g, ns = sys.argv[1], int(sys.argv[2])
m.compiled(16, 576**-0.5, False, False, ns, g)
print("compiled", g, ns)
