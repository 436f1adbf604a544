"""Rounds of the candidate select's threshold search, replayed in numpy: the case for ``_moment_probes``.

Replays ``_kth_largest_interpolated`` (four probes a round: the interpolated position of the k-th image minus and
plus a width, the bracket's value and image midpoints) on the order images of block maxima (16384 blocks of 8,
k' = 2047: the V4.1 candidate shape), opening either with the interpolated round or with the moments round
(``mean + sd * (z + d)``, ``d`` in -0.3, -0.1, 0.1, 0.3, ``z`` the normal quantile of the k-th's place). Prints,
per kind of row, the mean and worst number of rounds and the images left in the bracket after the first round.
Usage: python scripts/cand_search_sim.py [TRIALS]
"""
import sys
from statistics import NormalDist

import numpy as np


def order_images(values):
    """uint32 order images (as int64) of fp32 ``values``: unsigned order = value order."""
    bits = values.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(bits < 0, (~bits) & 0xFFFFFFFF, bits | 0x80000000)


def image_value(image):
    bits = image & 0x7FFFFFFF if image & 0x80000000 else (~image) & 0xFFFFFFFF
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def clamped_probe(value, low, high):
    return int(min(max(order_images(np.array([value]))[0], low + 1), high - 1))


def search_rounds(images, values, k, opening):
    """Rounds to the k-th largest image and the bracket's size after the first round."""
    low, high = int(images.min()), int(images.max()) + 1
    low_count, high_count = len(images), 0
    rounds, first_bracket = 0, None
    while low_count > k and high - low > 1:
        low_value, high_value = image_value(low), image_value(high - 1)
        span = high_value - low_value
        in_bracket = low_count - high_count
        if rounds == 0 and opening == "moments":
            mean, sd = values.mean(), values.std()
            z = NormalDist().inv_cdf(1 - k / len(images))
            probes = [clamped_probe(mean + sd * (z + d), low, high) for d in (-0.3, -0.1, 0.1, 0.3)]
        else:
            guess = low_value + span * ((low_count - k) / in_bracket)
            width = span * (1 / 64 + 0.5 / in_bracket)
            probes = [clamped_probe(guess - width, low, high), clamped_probe(guess + width, low, high),
                      clamped_probe(low_value + span * 0.5, low, high), low + (high - low) // 2]
        for probe in probes:
            count = int((images >= probe).sum())
            if count >= k and probe > low:
                low, low_count = probe, count
            elif count < k and probe < high:
                high, high_count = probe, count
        rounds += 1
        if first_bracket is None:
            first_bracket = low_count - high_count
    return rounds, first_bracket


def rows(kind, generator):
    logits = generator.standard_normal((16384, 8))
    if kind == "lognormal":
        logits = np.exp(2 * logits)
    elif kind == "relu":
        logits = np.maximum(logits, 0) * generator.random((16384, 1))
    elif kind == "uniform":
        logits = generator.random((16384, 8))
    elif kind == "ties":
        logits = np.round(logits * 4) / 4
    maxima = logits.max(axis=1).astype(np.float32)[:-1]  # the pinned newest block is not searched
    return order_images(maxima), maxima.astype(np.float64)


def main(trials):
    print("| rows | opening | rounds, mean (worst) | images in the bracket after round 1, mean |")
    print("| --- | --- | ---: | ---: |")
    for kind in ("normal", "relu", "lognormal", "uniform", "ties"):
        generator = np.random.default_rng(3)
        results = {"interpolated": [], "moments": []}
        for _ in range(trials):
            images, values = rows(kind, generator)
            for opening in results:
                results[opening].append(search_rounds(images, values, 2047, opening))
        for opening, runs in results.items():
            rounds = [r for r, _ in runs]
            print(f"| {kind} | {opening} | {np.mean(rounds):.1f} ({max(rounds)}) | "
                  f"{np.mean([b for _, b in runs]):.0f} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
