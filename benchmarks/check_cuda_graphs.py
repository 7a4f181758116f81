"""Does the fused op give the same answer under CUDA-graph replay as eagerly? (diagnostic)

    python benchmarks/check_cuda_graphs.py

Prints, for a Mixtral-like layer in bf16 at several token counts: |op - torch staged path| eagerly,
and |replayed graph - eager op| (0 means replay reproduces the eager op exactly).
"""
import torch

from moe_compile import fused_moe


def main():
    torch.manual_seed(0)
    hidden, inter, experts, top_k = 1024, 2048, 8, 2
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda") * 0.02).bfloat16().transpose(1, 2)
    w2 = (torch.randn(experts, hidden, inter, device="cuda") * 0.02).bfloat16().transpose(1, 2)
    for tokens in (1, 32, 64, 256):
        x = torch.randn(tokens, hidden, device="cuda").bfloat16()
        logits = torch.randn(tokens, experts, device="cuda").bfloat16()
        eager = fused_moe(x, logits, experts, top_k, w13, w2, renormalize=True)
        ref = fused_moe(x, logits, experts, top_k, w13, w2, renormalize=True, lowering="cpu")
        static_x, static_l = x.clone(), logits.clone()
        fused_moe(static_x, static_l, experts, top_k, w13, w2, renormalize=True)  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe(static_x, static_l, experts, top_k, w13, w2, renormalize=True)
        x2 = torch.randn(tokens, hidden, device="cuda").bfloat16()
        l2 = torch.randn(tokens, experts, device="cuda").bfloat16()
        static_x.copy_(x2)
        static_l.copy_(l2)
        graph.replay()
        torch.cuda.synchronize()
        eager2 = fused_moe(x2, l2, experts, top_k, w13, w2, renormalize=True)
        rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
        print("tokens %4d  op vs torch path %.2e   replay vs eager op %.2e" % (tokens, rel(eager, ref), rel(out, eager2)))


if __name__ == "__main__":
    main()
