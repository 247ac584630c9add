"""``attnres report NAME``: REPORT.md and PNG figures from an experiment's cached runs alone.

No training happens here: every number is read back from the run directories
(summary.json, probes.json, metrics.jsonl, config.json, run.json). A partial
suite gives a partial report, marked as such at the top, with the runs still
missing. The report kind (``[experiment] report``) picks the sections:

========== ===================== =====================================================
kind       axes it reads          what it adds
========== ===================== =====================================================
scaling    size, scheme           per-size table, L = A·C^-α fits per scheme, compute
                                  multiplier at the largest budget, seed-bootstrap
                                  intervals, the fits without the largest size, Figure 4
ablations  variant                Table 4 beside the paper: Δ vs baseline and ranks
block-size variant                Figure 6: loss against the block size S
arena      scheme, budget         equal tokens and equal wall-clock; loss vs tokens/time
dynamics   scheme                 Figure 5 b/c (output and gradient magnitude per
                                  block), Figure 8 heatmaps, Figure 9 mixing matrices
arch-sweep shape, scheme          loss against d_model/L_b, optimum per scheme
demo       scheme                 ``attnres demo``'s page of its own: one table row per
                                  scheme, loss curves, depth-weight heatmaps
kimi-linear backbone, scheme      per backbone: loss, paired Δ and step-time ratio vs the
                                  baseline, MoE load balance, depth-weight heatmaps; the
                                  verdicts of the two backbones side by side
retrofit   arm                    PreNorm retrofitted to Block / Full at step S vs continued:
                                  paired Δ, query norms and routing entropy over time
lr-sweep   lr, backbone, scheme   per backbone the loss at each learning rate, each
                                  arm's best rate, Block / Full vs the baseline each at
                                  its best rate, MoE load balance, the share of the Kimi
                                  Linear gain kept with dense MLPs
additive   backbone, scheme       per backbone: additive routing against the baseline and the
                                  replacement arm of its family, each learned gain's final
                                  RMS and whether its runs test additive routing at all
                                  (gain RMS >= 0.1, or the fixed unit gain); gain RMS
                                  against the training step
generic    any                    groups with mean ± std and paired Δ vs the baseline
========== ===================== =====================================================

One module per report kind (``scaling``, ``ablations``, ``block_size``, ``arena``, ``dynamics``,
``arch_sweep``, ``kimi_linear``, ``lr_sweep``, ``demo``, ``retrofit``, ``additive``, ``generic``), what they share in
``common`` (the ``Report`` page, tables, numbers) and ``sections`` (status, provenance, statistics, all runs);
``page.write_report`` picks the sections of a spec's kind; ``verdicts`` builds docs/experiments.md's verdict
table from the reports' corrected comparisons.
"""

from attnres.experiments.reports.common import shares_sublayer_init
from attnres.experiments.reports.demo import demo_table
from attnres.experiments.reports.page import (
    DEFAULT_REPORTS_ROOT,
    REPORT_FILE,
    write_report,
)

__all__ = ["DEFAULT_REPORTS_ROOT", "REPORT_FILE", "demo_table", "shares_sublayer_init", "write_report"]
