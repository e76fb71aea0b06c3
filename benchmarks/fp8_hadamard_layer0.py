"""BENCHMARKS.md §19's diagnosis (PYTHONPATH=src python benchmarks/fp8_hadamard_layer0.py). Qwen2.5, one 1K window of War and Peace: FP8 E4M3 (per-tensor amax scale) error of the
post-RoPE keys and of the values, with and without the Hadamard rotation, split into the part constant
over tokens (per head and channel; softmax ignores it for keys) and the token-varying part."""
import torch
import transformers

from kvbits.cache.compat import cache_kwargs
from kvbits.evaluate.data import load_text, tokenize
from kvbits.evaluate.models import load_model
from kvbits.quant.fp8 import dequantize_fp8, quantize_fp8
from kvbits.quant.rotate import rotate

torch.set_num_threads(2)
for name in ("smollm2-135m", "qwen2.5-coder-0.5b"):
    lm = load_model(name)
    ids = tokenize(load_text("war-and-peace"), lm.tokenizer)[:1024]
    cache = transformers.DynamicCache(config=lm.model.config)
    with torch.no_grad():
        lm.model(ids[None], **cache_kwargs(cache, lm.model), use_cache=True)
    rows = []
    for i, layer in enumerate(cache.layers):
        row = []
        for x in (layer.keys, layer.values):
            for rot in (False, True):
                y = rotate(x, "hadamard") if rot else x.float()
                scale = (y.abs().max() / 448).float()
                codes, _ = quantize_fp8(y, scale, "e4m3")
                err = dequantize_fp8(codes, scale, torch.float64) - y.double()
                var = y.double() - y.double().mean(dim=2, keepdim=True)
                err_var = err - err.mean(dim=2, keepdim=True)
                row.append(float(err_var.norm() / var.norm()))  # token-varying error over token-varying signal
        rows.append(row)
    t = torch.tensor(rows)
    print(name, "median over layers of |token-varying error| / |token-varying signal|:")
    print(f"  keys: plain {t[:,0].median():.4f}, rotated {t[:,1].median():.4f} (max {t[:,0].max():.4f} / {t[:,1].max():.4f})")
    print(f"  values: plain {t[:,2].median():.4f}, rotated {t[:,3].median():.4f} (max {t[:,2].max():.4f} / {t[:,3].max():.4f})")
    worst = int(t[:,1].argmax()); print(f"  worst rotated-key layer {worst}: plain {t[worst,0]:.4f} rotated {t[worst,1]:.4f}")
    print("  layer 0 keys: plain {:.4f} rotated {:.4f}; values: plain {:.4f} rotated {:.4f}".format(*tuple(t[0].tolist())))
    k = cache.layers[0].keys.float()
    print("  layer 0 keys: |mean over tokens| max {:.1f}, token-varying std {:.3f}; rotated: |mean| max {:.1f}, std {:.3f}".format(
        k.mean(2).abs().max(), (k - k.mean(2, keepdim=True)).std(), rotate(k, "hadamard").mean(2).abs().max(),
        (rotate(k, "hadamard") - rotate(k, "hadamard").mean(2, keepdim=True)).std()))
