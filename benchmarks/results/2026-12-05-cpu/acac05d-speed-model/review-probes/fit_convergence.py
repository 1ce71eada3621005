"""_fit_workers stops after FIT_ROUNDS=100 alternating rounds: on a chain of workers linked by
pairwise-shared prefixes it is far from its own least-squares optimum (compare numpy's exact solve)."""
import numpy as np
from dask_octopus.profiling import speedmodel as sm

def exact(entries, prior):
    ws = sorted({w for _, w, _, _ in entries}); ps = sorted({p for p, _, _, _ in entries}, key=str)
    A = np.zeros((len(entries), len(ps) + len(ws))); y = np.zeros(len(entries)); wt = np.zeros(len(entries))
    for r, (p, w, weight, v) in enumerate(entries):
        A[r, ps.index(p)] = 1; A[r, len(ps) + ws.index(w)] = 1; y[r] = v; wt[r] = weight
    sw = np.sqrt(wt)
    sol = np.linalg.lstsq(A * sw[:, None], y * sw, rcond=None)[0]
    b = sol[len(ps):]
    b += np.mean([prior.get(w, 0) for w in ws]) - b.mean()
    return dict(zip(ws, b))

for n in (5, 10, 20, 40):
    # true log speeds: worker i has log speed 0.1*i; prefix k runs on workers k and k+1 (a chain)
    entries = []
    for k in range(n - 1):
        for i in (k, k + 1):
            entries.append((f"p{k}", f"w{i:02d}", 1.0, 0.1 * i - 0.05 * (2 * k + 1)))  # centred per prefix
    got = sm._fit_workers(entries, {})
    want = exact(entries, {})
    err = max(abs(got[w] - want[w]) for w in want)
    spread_true = 0.1 * (n - 1)
    print(f"chain of {n} workers: max |fit - exact| = {err:.3f} (true first-to-last log-speed spread {spread_true:.2f});"
          f" fitted spread {max(got.values()) - min(got.values()):.3f}")
