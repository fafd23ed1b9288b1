"""What every benchmark script shares: its common options, its header, its tables, its file.

A benchmark measures something, prints it, and appends a dated section to a Markdown results
file under ``experiments/results/``. The pieces of that which do not depend on what is measured
live here, so that the scripts agree on them and none borrows from another:

* **options** -- :func:`add_run_args` and the single-option helpers (batches, first seed,
  per-batch budget, device, dataset, results file) with the list parsers they use;
* **header** -- :func:`section_heading` (UTC date and time, the command) and
  :func:`machine_line` (CPU model, cores, torch threads, device, versions, commit), so that
  seconds measured on different machines or code are never compared by mistake;
* **tables** -- :func:`table_header`, :func:`table_row`, :func:`markdown_table`;
* **results** -- :func:`start_section` (create the file with its title and introduction,
  then open this run's section at the end of the file) and :func:`append_lines` (rows and
  notes, written as they finish so an interrupted run keeps what it measured).

Results files open with a summary maintained by hand, followed by the dated sections the
scripts append at the end.
"""

from experiments.harness.machine import (
    code_version,
    command_line,
    cpu_name,
    machine_line,
    resolve_device,
    section_heading,
    utc_now,
)
from experiments.harness.options import (
    add_batches,
    add_dataset,
    add_device,
    add_first_seed,
    add_max_seconds,
    add_out,
    add_run_args,
    check_run_args,
    json_value,
    list_of,
    parse_assignments,
    parse_list,
    parse_settings,
    python_value,
)
from experiments.harness.paths import RESULTS_DIR, ROOT
from experiments.harness.tables import (
    append_lines,
    markdown_table,
    start_section,
    table_header,
    table_row,
)

__all__ = [
    "RESULTS_DIR",
    "ROOT",
    "code_version",
    "command_line",
    "cpu_name",
    "machine_line",
    "resolve_device",
    "section_heading",
    "utc_now",
    "add_batches",
    "add_dataset",
    "add_device",
    "add_first_seed",
    "add_max_seconds",
    "add_out",
    "add_run_args",
    "check_run_args",
    "json_value",
    "list_of",
    "parse_assignments",
    "parse_list",
    "parse_settings",
    "python_value",
    "append_lines",
    "markdown_table",
    "start_section",
    "table_header",
    "table_row",
]
