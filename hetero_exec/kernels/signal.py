"""Signal processing: DFT, STFT, window functions, MelWeightMatrix.

Complex tensors are ONNX-style real tensors with a trailing dimension of 2 (real,
imag); a trailing 1 means a real signal. The transforms use ``xp.fft`` (pocketfft on
numpy, cuFFT on cupy).
"""

from __future__ import annotations

import math

import numpy as np

from hetero_exec.kernels._common import host_ints, host_scalar, np_dtype
from hetero_exec.kernels.registry import kernel


def _to_complex(xp, x):
    """(..., 1|2) real tensor -> (signal, is_real) in a dtype xp.fft handles."""
    work = x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)
    if x.shape[-1] == 1:
        return work[..., 0], True
    if x.shape[-1] != 2:
        raise ValueError(f"the last dimension of a DFT input must be 1 or 2, got {x.shape[-1]}")
    return work[..., 0] + 1j * work[..., 1], False


def _from_complex(xp, y, dtype):
    """complex (or real) array -> (..., 2) (or (..., 1)) array of ``dtype``."""
    if y.dtype.kind == "c":
        return xp.stack((y.real, y.imag), axis=-1).astype(dtype, copy=False)
    return y[..., None].astype(dtype, copy=False)


def _dft(xp, sig, is_real, n, axis, inverse, onesided):
    if inverse:
        if onesided:
            return xp.fft.irfft(sig, n=n, axis=axis)
        return xp.fft.ifft(sig, n=n, axis=axis)
    if onesided:
        if is_real:
            return xp.fft.rfft(sig, n=n, axis=axis)
        y = xp.fft.fft(sig, n=n, axis=axis)
        idx = [slice(None)] * y.ndim
        idx[axis] = slice(0, n // 2 + 1)
        return y[tuple(idx)]
    return xp.fft.fft(sig, n=n, axis=axis)


@kernel("DFT", since=(17, 20), host_inputs=(1, 2))
def DFT(xp, input, dft_length=None, axis=None, *, inverse=0, onesided=0, opset=20):
    """``axis`` is an attribute (default 1) at opset 17 and an input (default -2) from 20."""
    rank = input.ndim
    if axis is None:
        axis = 1 if opset < 20 else -2
    elif not isinstance(axis, int):
        axis = host_ints(axis)[0]
    axis = axis % rank
    if axis == rank - 1:
        raise ValueError("DFT axis cannot be the last (real/imaginary) dimension")
    if dft_length is not None and not isinstance(dft_length, int):
        dft_length = host_ints(dft_length)[0]
    if dft_length is None:
        dft_length = 2 * (input.shape[axis] - 1) if (inverse and onesided) else input.shape[axis]
    sig, is_real = _to_complex(xp, input)
    y = _dft(xp, sig, is_real, int(dft_length), axis, bool(inverse), bool(onesided))
    return (_from_complex(xp, y, input.dtype),)


@kernel("STFT", since=17, host_inputs=(1, 3))
def STFT(xp, signal, frame_step, window=None, frame_length=None, *, onesided=1):
    step = frame_step if isinstance(frame_step, int) else host_ints(frame_step)[0]
    if frame_length is not None and not isinstance(frame_length, int):
        frame_length = host_ints(frame_length)[0]
    if frame_length is None:
        frame_length = window.shape[0] if window is not None else signal.shape[-2]
    length = signal.shape[-2]
    n_frames = 1 + (length - frame_length) // step
    sig, is_real = _to_complex(xp, signal)  # (batch, length)
    idx = xp.arange(n_frames)[:, None] * step + xp.arange(frame_length)[None, :]
    frames = sig[:, idx]  # (batch, frames, frame_length)
    if window is not None:
        frames = frames * window.astype(frames.real.dtype, copy=False)
    y = _dft(xp, frames, is_real, frame_length, -1, False, bool(onesided))
    return (_from_complex(xp, y, signal.dtype),)


def _window(xp, size, periodic, output_datatype, terms):
    """Generalised cosine window sum_k a_k cos(2 pi k n / N)."""
    n_size = size if isinstance(size, int) else host_ints(size)[0]
    dtype = np_dtype(output_datatype)
    if n_size <= 0:
        return (xp.zeros((0,), dtype=dtype),)
    denom = n_size if periodic else n_size - 1
    if denom == 0:
        return (xp.ones((1,), dtype=dtype),)
    phase = xp.arange(n_size, dtype=np.float64) * (2 * math.pi / denom)
    res = xp.full((n_size,), terms[0], dtype=np.float64)
    for k, a in enumerate(terms[1:], start=1):
        res = res + a * xp.cos(phase * k)
    return (res.astype(dtype),)


@kernel("HannWindow", since=17, host_inputs=(0,))
def HannWindow(xp, size, *, output_datatype=1, periodic=1):
    return _window(xp, size, periodic, output_datatype, (0.5, -0.5))


@kernel("HammingWindow", since=17, host_inputs=(0,))
def HammingWindow(xp, size, *, output_datatype=1, periodic=1):
    alpha = 25.0 / 46.0
    return _window(xp, size, periodic, output_datatype, (alpha, -(1 - alpha)))


@kernel("BlackmanWindow", since=17, host_inputs=(0,))
def BlackmanWindow(xp, size, *, output_datatype=1, periodic=1):
    return _window(xp, size, periodic, output_datatype, (0.42, -0.5, 0.08))


@kernel("MelWeightMatrix", since=17, host_inputs=(0, 1, 2, 3, 4))
def MelWeightMatrix(
    xp,
    num_mel_bins,
    dft_length,
    sample_rate,
    lower_edge_hertz,
    upper_edge_hertz,
    *,
    output_datatype=1,
):
    # a small constant-like table built on the host from host scalars
    n_mel = int(host_scalar(num_mel_bins))
    n_dft = int(host_scalar(dft_length))
    rate = host_scalar(sample_rate)
    low = host_scalar(lower_edge_hertz)
    high = host_scalar(upper_edge_hertz)
    n_bins = n_dft // 2 + 1
    low_mel = 2595 * np.log1p(low / 700) / np.log(10)
    high_mel = 2595 * np.log1p(high / 700) / np.log(10)
    step = (high_mel - low_mel) / (n_mel + 2)
    hz = 700 * np.expm1((np.arange(n_mel + 2) * step + low_mel) / 2595 * np.log(10))
    edges = (((n_dft + 1) * hz) // rate).astype(np.int64)
    lo, ce, hi = edges[:-2][None, :], edges[1:-1][None, :], edges[2:][None, :]
    j = np.arange(n_bins)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        rise = np.where(ce > lo, (j - lo) / np.maximum(ce - lo, 1), 1.0)
        fall = (hi - j) / np.maximum(hi - ce, 1)
    out = np.where((j >= lo) & (j <= ce) & ((ce > lo) | (j == ce)), rise, 0.0)
    out = np.where((j >= ce) & (j < hi), fall, out)
    return (xp.asarray(out.astype(np_dtype(output_datatype))),)
