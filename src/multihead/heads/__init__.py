"""Head tools: see, score and cut the heads of any multihead module (and of a transformers model attached
to multihead). :mod:`~multihead.heads.capture` records per-head weights; :mod:`~multihead.heads.gates`
puts a gate on every head's output; :mod:`~multihead.heads.importance` scores heads (gradient,
ablation, entropy); :mod:`~multihead.heads.surgery` is the one head-row selector and mean-into-bias
fold; :mod:`~multihead.heads.pruning` removes heads physically and draws the pruning curve;
:mod:`~multihead.heads.observe` gives the same tools any module that calls SDPA; :mod:`~multihead.heads.patching`
runs activation patching per head (a causal experiment on a chosen behaviour); :mod:`~multihead.heads.circuits`
finds circuits: edge attribution between heads' outputs and their q/k/v inputs (EAP, EAP-IG), exact edge patching and
faithfulness by intervention; :mod:`~multihead.heads.mib` does it MIB's way (a dataset of padded prompt pairs, MIB's
graph file); :mod:`~multihead.heads.neurons`
scores and cuts feed-forward neurons the same way (past the heads' share of the work).
Everything works through each module's own hook list (:mod:`multihead.layer.hooks`).
"""

from multihead.heads import timm_forms as _timm_forms  # noqa: F401 - registers timm's SDPA forms with observe
from multihead.heads.capture import Captured, capture
from multihead.heads.circuits import (
    CONSTRUCTIONS,
    EDGE_METHODS,
    MIB_BUDGETS,
    CircuitCurve,
    CircuitGraph,
    EdgeScores,
    Faithfulness,
    FaithfulnessCurve,
    NodeScores,
    circuit_graph,
    edge_attribution,
    faithfulness,
    faithfulness_curve,
    node_attribution,
    patch_edges,
)
from multihead.heads.gates import attention_modules, gated
from multihead.heads.importance import (
    METHODS,
    Importance,
    ablation_importance,
    entropy_importance,
    gradient_importance,
    importance,
)
from multihead.heads.mib import (
    PromptPairs,
    dataset_attribution,
    dataset_faithfulness,
    dataset_faithfulness_curve,
    mib_names,
    prompt_pairs,
    read_mib_graph,
    write_mib_graph,
)
from multihead.heads.neurons import ffn_blocks, prune_neurons
from multihead.heads.observe import observe, observed, unobserve
from multihead.heads.patching import Patching, attribution, patch, path_patch
from multihead.heads.pruning import (
    Curve,
    head_counts,
    mean_head_outputs,
    plot_curve,
    prune,
    pruning_curve,
    resize,
    save_curve,
)

__all__ = ["CONSTRUCTIONS", "Captured", "CircuitCurve", "CircuitGraph", "Curve", "EDGE_METHODS", "EdgeScores",
           "Faithfulness", "FaithfulnessCurve", "Importance", "METHODS", "MIB_BUDGETS", "NodeScores", "Patching",
           "PromptPairs", "ablation_importance", "attention_modules", "attribution", "capture", "circuit_graph",
           "dataset_attribution", "dataset_faithfulness", "dataset_faithfulness_curve", "edge_attribution",
           "entropy_importance", "faithfulness", "faithfulness_curve", "ffn_blocks", "gated", "gradient_importance",
           "head_counts", "importance", "mean_head_outputs", "mib_names", "node_attribution", "observe", "observed",
           "patch", "patch_edges", "path_patch", "plot_curve", "prompt_pairs", "prune", "prune_neurons",
           "pruning_curve", "read_mib_graph", "resize", "save_curve", "unobserve", "write_mib_graph"]
