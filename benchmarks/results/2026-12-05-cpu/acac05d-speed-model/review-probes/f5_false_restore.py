"""A genuine, lasting 2x / 1.5x slowdown (25% and 35% lognormal noise): how often does the new rule
restore the pre-change (fast) level, and how far off is a's weight right after?"""
import math, random
from common import new
orig = new._Rate._back_before_change
events = []
def spy(self):
    r = orig(self)
    if r: events.append(1)
    return r
new._Rate._back_before_change = spy
for factor, sigma in ((2.0, 0.25), (1.5, 0.25), (2.0, 0.35)):
    events.clear(); worst = []
    for seed in range(200):
        rng = random.Random(seed); m = new.SpeedModel(); n0 = len(events)
        for i in range(100):
            m.observe("a", "p", 100, (factor if i >= 50 else 1.0) * rng.lognormvariate(0, sigma))
            m.observe("b", "p", 100, rng.lognormvariate(0, sigma))
            if len(events) > n0 and i >= 50:
                worst.append(m.weights("ab")["a"]); n0 = len(events)
    print(f"{factor}x, sigma {sigma}: restores of the fast level after a lasting slowdown: {len(events)} in 200 runs;"
          f" a's weight right after: {sorted(round(w,3) for w in worst)[:8]} (truth {1/(1+factor):.3f})")

# how long the wrongly restored level lasts (timings with a's weight > 0.45, truth 0.333), new vs old
from common import old
for name, mod in (("old", old), ("new", new)):
    spells = []
    for seed in range(200):
        rng = random.Random(seed); m = mod.SpeedModel(); run = 0
        for i in range(100):
            m.observe("a", "p", 100, (2.0 if i >= 50 else 1.0) * rng.lognormvariate(0, 0.25))
            m.observe("b", "p", 100, rng.lognormvariate(0, 0.25))
            if i >= 62:  # once the slowdown was followed
                run += m.weights("ab")["a"] > 0.45
        spells.append(run)
    print(f"{name}: runs with a's weight > 0.45 at some timing 62..99: {sum(s > 0 for s in spells)}/200, timings in all: {sum(spells)}")
