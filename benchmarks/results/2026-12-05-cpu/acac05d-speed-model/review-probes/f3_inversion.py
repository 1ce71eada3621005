"""Both workers run x (a 4x slower), then other work (y, equal on both), then x again, once each in
turn with other work between (an iterative job: x's tasks come between others'). a stays 4x slower on x
throughout; every timing of x confirms it."""
from common import new, old
def y(m, n):
    for _ in range(n):
        m.observe("a", "y", 100, 0.1)
        m.observe("b", "y", 100, 0.1)
for name, mod in (("old", old), ("new", new)):
    m = mod.SpeedModel()
    for _ in range(5):
        m.observe("a", "x", 100, 4.0)
        m.observe("b", "x", 100, 1.0)
    y(m, 100)
    m.observe("b", "x", 100, 1.0)
    r1 = m.weights("ab", prefix="x")["a"]
    y(m, 25)
    m.observe("a", "x", 100, 4.0)   # a back on x: 4x slower, as before
    r2 = m.weights("ab", prefix="x")["a"], m.weights("ab")["a"]
    print(f"{name}: a's weight on x after b's timing {r1:.3f}; after a's own 4x-slow timing {r2[0]:.3f} "
          f"(all prefixes {r2[1]:.3f}); truth 0.200")
