"""Helpers of the GPU tests: run a call with the host's synchronisation turned into an error, and capture a call in a
CUDA graph after warming it up on a side stream (as the runtime's metadata graphs do)."""

import torch


def without_host_sync(fn):
    """fn() with torch's sync debug mode on "error": any host synchronisation inside raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def captured(fn):
    """(a CUDA graph of fn(), what the captured call returned); fn runs once on a side stream first (warm-up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
