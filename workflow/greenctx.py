"""A stream whose kernels run on only some of the GPU's SMs: a CUDA green context's (driver API, CUDA 12.4+).

Serving's decode steps and the detokenizer's calls share the GPU, and each stretches the other's time by taking
its SMs (levers.md, "H200 codec beside decode"); a green context keeps one of them to some. A CUDA graph runs on
the SMs of the stream it was captured on, wherever it is replayed (the same probe): so graphs meant for fewer SMs
are captured on this stream (`cudagraphs.Graphs.confine`).

Made through cuda-python's driver bindings (`cuda.bindings.driver`, the `cuda-bindings` package), which the
GPU image has; PyTorch's own `torch.cuda.green_contexts` gives a stream only in recent versions."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GreenStream:
    """A stream of a green context of `sms` SMs, `asked` rounded up by the driver to its granularity (8 on
    Hopper). The context stays alive while this object does."""

    stream: torch.cuda.Stream
    asked: int
    sms: int
    context: object  # the driver's CUgreenCtx
    setting: str  # the setting that asked for it, named in errors


def _checked(result: tuple, what: str, setting: str) -> object:
    """A cuda-python call's value, or a one-line error naming the setting and the call."""
    err, *value = result
    if int(err):
        raise RuntimeError(f"{setting}: green context: {what} failed ({err})")
    return value[0] if len(value) == 1 else value


def green_stream(device: torch.device, sms: int, priority: int, setting: str) -> GreenStream:
    """A stream at `priority` whose kernels run on `sms` of `device`'s SMs (as the driver rounds it); errors name `setting`."""
    try:
        from cuda.bindings import driver
    except ImportError:
        raise RuntimeError(f"{setting}: a green context needs cuda-python's bindings (pip install cuda-bindings)") from None
    index = torch.cuda.current_device() if device.index is None else device.index
    total = torch.cuda.get_device_properties(index).multi_processor_count
    if not 0 < sms < total:
        raise ValueError(f"{setting}: {sms} SMs; this GPU has {total}: give fewer, or 0 for all of them")
    torch.cuda.init()  # the driver initialised (cuInit) before its calls
    dev = _checked(driver.cuDeviceGet(index), "cuDeviceGet", setting)
    whole = _checked(driver.cuDeviceGetDevResource(dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM), "its SMs", setting)
    groups, _, _ = _checked(driver.cuDevSmResourceSplitByCount(1, whole, 0, sms), f"splitting off {sms} SMs", setting)
    desc = _checked(driver.cuDevResourceGenerateDesc([groups[0]], 1), "cuDevResourceGenerateDesc", setting)
    flags = driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
    context = _checked(driver.cuGreenCtxCreate(desc, dev, flags), "cuGreenCtxCreate", setting)
    nonblocking = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
    raw = _checked(driver.cuGreenCtxStreamCreate(context, nonblocking, priority), "cuGreenCtxStreamCreate", setting)
    stream = torch.cuda.ExternalStream(int(raw), device=torch.device("cuda", index))
    return GreenStream(stream, sms, int(groups[0].sm.smCount), context, setting)
