"""Every figure and interactive explorer of the course, in matplotlib (imported only when used).

lesson 01  plot_memory_hierarchy, plot_roofline, roofline_explorer  (numbers from flashlab.roofline)
lesson 02  plot_naive_traffic, plot_memory_vs_n, plot_step_times, peak_memory
lesson 03  plot_overflow, plot_online_softmax, online_softmax_trace, plot_merge, online_softmax_explorer
lesson 04  plot_tile_order, plot_traffic_vs_sram, plot_block_heatmap, sram_explorer
lesson 05  plot_causal_blocks, plot_work_split, plot_occupancy, plot_traffic_vs_n, plot_io_compare, fa_explorer
lesson 06  plot_saved_for_backward, plot_backward_order
lesson 10  wave_explorer (flashlab.viz.waves)
lesson 11  fp8_explorer (flashlab.viz.fp8)
lesson 14  split_explorer (flashlab.viz.decoding)
lessons 15-17  fragment_explorer and the fragment, format, kernel and speed figures (flashlab.viz.tensor)
lesson 18  the option figures: tile grids, GQA map, ALiBi, softcap, dropout, varlen, block table (flashlab.viz.real_api)

Each plot_* returns a matplotlib Figure (and draws into `ax=` when given one). Explorers show
ipywidgets sliders in a live kernel and a static grid of small plots otherwise, or in the fast mode.
"""
from ._base import explore, to_png, use_widgets, widgets_available
from .decoding import split_explorer
from .fp8 import fp8_explorer
from .memory import (peak_memory, plot_memory_hierarchy, plot_memory_vs_n, plot_naive_traffic, plot_roofline,
                     plot_saved_for_backward, plot_step_times, roofline_explorer)
from .softmax import online_softmax_explorer, online_softmax_trace, plot_merge, plot_online_softmax, plot_overflow
from .tensor import fragment_explorer
from .tiles import (TileTracer, backward_round_trips, plot_backward_order, plot_causal_blocks, plot_occupancy,
                    plot_tile_order, plot_work_split, trace_tiles)
from .waves import wave_explorer
from .traffic import (block_traffic_grid, fa_explorer, fits, plot_block_heatmap, plot_io_compare,
                      plot_traffic_vs_n, plot_traffic_vs_sram, sram_explorer, traffic_bytes)

__all__ = [
    "explore", "to_png", "use_widgets", "widgets_available",
    "peak_memory", "plot_memory_hierarchy", "plot_memory_vs_n", "plot_naive_traffic", "plot_roofline",
    "plot_saved_for_backward", "plot_step_times", "roofline_explorer",
    "online_softmax_explorer", "online_softmax_trace", "plot_merge", "plot_online_softmax", "plot_overflow",
    "fp8_explorer", "split_explorer", "fragment_explorer", "wave_explorer",
    "TileTracer", "backward_round_trips", "plot_backward_order", "plot_causal_blocks", "plot_occupancy", "plot_tile_order", "plot_work_split", "trace_tiles",
    "block_traffic_grid", "fa_explorer", "fits", "plot_block_heatmap", "plot_io_compare", "plot_traffic_vs_n",
    "plot_traffic_vs_sram", "sram_explorer", "traffic_bytes",
]
