import json, sys
from jobs.bench.emulation import step_row
real = {}
for l in open('benchmarks/device/2026-11-26/calib.jsonl'):
    r = json.loads(l); real[(r['model'], r['batch'], r['precision'])] = r['step_s']
rows = []
for m, b in [('resnet50-224', 32), ('vgg19-224', 32), ('vgg19-22k-224', 32), ('transformer-big', 64), ('fc-heavy', 64), ('char-lstm', 64)]:
    for dev in ('h100', f'benchmarks/device/2026-11-26/profiles/{m}-b{b}-h100-tf32.json'):
        r = step_row(m, dev, 10, 2)
        t = real[(m, b, 'tf32')]
        kind = 'roofline' if dev == 'h100' else 'profile'
        print(f"{m:16} {kind:8} modelled {r['modelled_s']*1e3:7.2f} T_iter {r['t_iter_s']*1e3:7.2f} real {t*1e3:7.2f}  modelled/real {r['modelled_s']/t-1:+.1%}  T_iter/real {r['t_iter_s']/t-1:+.1%}", flush=True)
        rows.append(dict(model=m, batch=b, compute=kind, spec=dev, modelled_s=r['modelled_s'], t_iter_s=r['t_iter_s'], real_s=t, batch_used=r['batch']))
json.dump(rows, open(sys.argv[1], 'w'), indent=1)
