import sys, torch
from pathlib import Path
d = Path(sys.argv[1])
for f in sorted(d.glob("losses_*.pt")):
    r = torch.load(f); ref, got = r["ref"], r["got"]
    rel = [float(((a.float() - b.float()).abs() / a.float().abs()).max()) for a, b in zip(ref, got)]
    mean = [(float(a.float().mean()), float(b.float().mean())) for a, b in zip(ref, got)]
    print(f"{d.name} {f.stem[7:]}: mean loss before step ref {mean[0][0]:.6f} got {mean[0][1]:.6f}; after step ref "
          f"{mean[1][0]:.6f} got {mean[1][1]:.6f}; max per-token rel diff before {rel[0]:.2e} after {rel[1]:.2e}; "
          f"bitwise {all(torch.equal(a, b) for a, b in zip(ref, got))}")
