"""The order `make test` hands the tests to its workers: the slowest first, spread over the workers.

xdist's ``--dist worksteal`` gives each of N workers one contiguous share of the collection (the first ``n // N``
tests, then ``(n - n // N) // (N - 1)`` of the rest, and so on); a worker that runs out takes the second half of the
longest queue (counted in tests, not seconds). Collected in file order, the slow tests sat wherever their file fell:
W7 (70 s) began 930 s into a 1000 s run and ran alone at the end while two workers idled. :func:`slow_first` puts the
slow units at the fronts of the shares, each to the share with the least slow time so far (longest first), and
fills every share up to its size with the other tests in their collected order; the cheap tests then balance the end
by stealing. A unit is one test, every parametrisation of one, or tests that share work done once per process (a
module fixture, a cache), which must stay on one worker: split, the work is done twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

# (the unit's node-id prefixes, its seconds): measured in a full `make test` run (3 workers, 2 cores, load ~6 from
# other work, 2026-11-28) -- only the order matters, so a figure a few seconds off changes
# nothing. A prefix is a node id, a test's name without its parameters, or a file (every test in it).
SLOW: list[tuple[tuple[str, ...], float]] = [
    (("tests/test_cli.py::test_demo_prints_and_writes_everything",), 247),  # trains the demo's two models (session)
    (("tests/test_hf_onnx.py",), 300),  # exports cached once per process
    (("tests/test_hf_every_family.py",), 262),  # the first shard imports every model class, once per process
    (("tests/test_hf_cli.py",), 190),  # st_ffn_pruned: a module fixture read by two tests
    (("tests/test_notebook.py",), 90),  # the executed notebook: a module fixture
    (("tests/test_docs.py",), 100),  # the built site: a module fixture
    (("tests/test_patching.py::test_patching_finds_the_induction_head_of_a_model_trained_here",  # both train
      "tests/test_circuits.py::test_the_induction_circuit_found_by_edges"), 82),  # trained_induction(), cached
    (("tests/test_pruning.py::test_prune_minilm_writes_a_model_that_loads",), 72),
    (("tests/test_hf_packed.py::test_bench_w7_times_the_sentence_encoder_padded_and_padding_free",), 69),
    (("tests/test_readme.py::test_readme_python_block_runs[docs/how-to/find-a-circuit.md: Find the induction circuit]",
      ), 69),
    (("tests/test_modes.py::test_every_subject_in_every_mode_equals_eager",), 110),  # its compiled subjects, cached
    (("tests/test_distributed.py::test_bench_w6_writes_a_report_that_loads_back",), 35),
    (("tests/test_pruning_target.py::test_prune_hf_to_a_target_keeps_a_model_that_meets_it_and_loads_back",), 30),
    (("tests/test_pruning.py::test_prune_toy_writes_report_curve_and_a_loadable_model",), 32),
    (("tests/test_grader.py::test_a_submission_reads_and_reaches_nothing_but_itself",), 30),
    (("tests/test_decoder_export.py::test_genai_builds_the_pruned_model_and_generates_its_tokens",), 28),
    (("tests/test_decoder_export.py::test_genais_peer_is_its_builder_on_the_unpruned_checkpoint_made_once",), 16),
    (("tests/test_neurons.py::test_a_cut_model_saves_and_loads_back_in_multihead_and_transformers",), 28),
    (("tests/test_progress.py::test_a_log_gets_whole_lines_and_no_carriage_return",), 27),
    (("tests/test_readme.py::test_readme_python_block_runs[docs/how-to/serve-fastembed.md: Serve a pruned encoder "
      "with fastembed]",), 25),
    (("tests/test_readme.py::test_a_tutorial_runs_step_by_step_and_prints_what_it_shows",), 40),
    (("tests/test_distributed.py::test_ring_attention_equals_the_reference",), 38),
    (("tests/test_check.py::test_a_learners_keras_file_is_graded_from_the_command_line",), 21),
    # round 7 (an Intel Xeon, 3 workers, nothing else running, 2026-11-28)
    (("tests/test_decoder_prune.py::test_the_formats_users_run_are_written_and_each_read_back",), 120),
    (("tests/test_readme.py::test_readme_command_lines_run[Cut a decoder language model: prune 1]",), 90),
    (("tests/test_readme.py::test_readme_command_lines_run[Cut a decoder language model: prune 0]",), 31),
    (("tests/test_readme.py::test_readme_command_lines_run[Cut a decoder language model: prune 2]",), 50),
    (("tests/test_platforms.py::test_gradescope_autograder_grades_as_check_does",), 60),
    (("tests/test_platforms.py::test_github_classroom_workflow_reports_the_points_check_gives",), 54),
    (("tests/test_platforms.py::test_prairielearn_question_grades_as_check_does",), 47),
    (("tests/test_platforms.py::test_without_user_namespaces_a_platform_submission_cannot_forge_its_results",), 41),
    (("tests/test_decoder_export.py::test_gguf_vocabulary_written_from_the_models_own_tokenizer",), 58),
]


def matches(nodeid: str, prefix: str) -> bool:
    """Whether ``prefix`` names the test ``nodeid``: the node id itself, its test without the parameters, or its file."""
    return nodeid == prefix or nodeid.startswith((prefix + "::", prefix + "["))


def shares(n: int, workers: int) -> list[int]:
    """The sizes of the contiguous shares xdist's worksteal first gives ``workers`` workers of ``n`` tests."""
    sizes = []
    for k in range(workers):
        sizes.append(n // (workers - k))
        n -= sizes[-1]
    return sizes


def slow_first(items: Sequence[T], workers: int, slow: list[tuple[tuple[str, ...], float]] = SLOW,
               nodeid: Callable[[T], str] = lambda item: item.nodeid) -> list[T]:
    """``items`` reordered for ``workers`` worksteal workers: every share of :func:`shares` begins with the slow units
    given to it (longest first, each to the share with the least slow time so far), then the other items in their
    order. A unit's items keep their order; an entry of ``slow`` that names no item is passed over."""
    if workers < 1:
        raise ValueError(f"slow_first: workers must be >= 1; got {workers}")
    ids = [nodeid(item) for item in items]
    taken: set[int] = set()
    units = []
    for prefixes, seconds in slow:
        members = [i for i, x in enumerate(ids) if i not in taken and any(matches(x, p) for p in prefixes)]
        taken.update(members)
        if members:
            units.append((seconds, members))
    sizes = shares(len(items), workers)
    fronts: list[list[int]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for seconds, members in sorted(units, key=lambda u: -u[0]):  # stable: equal times keep the table's order
        room = [k for k in range(workers) if len(fronts[k]) + len(members) <= sizes[k]]
        k = min(room or range(workers), key=lambda k: (load[k], k))
        fronts[k] += members
        load[k] += seconds
    rest = [i for i in range(len(items)) if i not in taken]
    order: list[int] = []
    for k in range(workers):
        need = max(0, sizes[k] - len(fronts[k]))
        order += fronts[k] + rest[:need]
        del rest[:need]
    order += rest
    return [items[i] for i in order]
