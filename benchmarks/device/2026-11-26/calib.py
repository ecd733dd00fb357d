"""Real H100 training steps of the emulated models, for the device model's cross-check. Prints one JSON row each."""
import json, sys, time
import torch
from runtime.workloads.models import build_model, model_input, loss_fn

torch.backends.cudnn.benchmark = True
out = open(sys.argv[1], "w")
cases = [("resnet50-224", 32, "tf32"), ("vgg19-224", 32, "tf32"), ("transformer-big", 64, "tf32"),
         ("resnet50-224", 256, "tf32"), ("resnet50-224", 256, "amp"), ("vgg19-22k-224", 32, "tf32"),
         ("fc-heavy", 64, "tf32"), ("char-lstm", 64, "tf32"), ("resnet50-224", 32, "fp32"), ("vgg19-224", 32, "fp32")]
for name, batch, prec in cases:
    t0 = time.perf_counter(); model = opt = None
    try:
        tf = prec != "fp32"
        torch.backends.cuda.matmul.allow_tf32 = tf
        torch.backends.cudnn.allow_tf32 = tf
        torch.manual_seed(0)
        model = build_model(name).cuda()
        inputs, target = model_input(name, batch)
        inputs = tuple(t.cuda() for t in inputs); target = target.cuda()
        lf = loss_fn(name)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        def step():
            opt.zero_grad(set_to_none=False)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=prec == "amp"):
                loss = lf(model(*inputs), target)
            loss.backward(); opt.step()
        for _ in range(5): step()
        torch.cuda.synchronize()
        times = []
        for _ in range(15):
            a = torch.cuda.Event(enable_timing=True, blocking=True); b = torch.cuda.Event(enable_timing=True, blocking=True)
            a.record(); step(); b.record(); b.synchronize(); times.append(a.elapsed_time(b) / 1e3)
        times.sort(); med = times[len(times) // 2]
        row = dict(model=name, batch=batch, precision=prec, step_s=med, min_s=times[0], max_s=times[-1],
                   samples_per_s=batch / med, cudnn_benchmark=True, wall_s=time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - one model's failure must not stop the others
        row = dict(model=name, batch=batch, precision=prec, error=repr(e)[:500])
    print(json.dumps(row), flush=True); out.write(json.dumps(row) + "\n"); out.flush()
    del model, opt
    torch.cuda.empty_cache()
