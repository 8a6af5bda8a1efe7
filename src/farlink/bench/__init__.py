"""Side-by-side scenarios. Every benchmark runs its variants in one invocation on the same machine
(ratios, not absolute numbers, are what this noisy hardware can support) and writes a JSON table
plus PNG plots under ``--out``."""
