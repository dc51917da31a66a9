"""package.choose_regions: per graph, the non-overlapping regions that save the most."""

from __future__ import annotations

from kforge.package import RegionOption, choose_regions


def opt(card: str, nodes: str, kernel: float | None, baseline: float | None) -> RegionOption:
    return RegionOption(card, frozenset(nodes), kernel, baseline)


def test_disjoint_regions_that_save_time_all_ship():
    a, b = opt("a", "xy", 1.0, 3.0), opt("b", "zw", 2.0, 2.5)
    assert choose_regions([a, b]) == [a, b]


def test_a_region_that_saves_nothing_or_has_no_timing_never_ships():
    assert choose_regions([opt("slow", "xy", 3.0, 3.0), opt("untimed", "zw", None, 4.0),
                           opt("no-baseline", "uv", 1.0, None)]) == []


def test_overlap_keeps_the_set_with_the_largest_total_saving():
    # The epilogue (conv + bn + add + relu) saves 6; inside it, the fused bn+add+relu saves 4
    # and the conv's own region nothing: one epilogue beats the fused region.
    epilogue = opt("epi", "cbar", 4.0, 10.0)
    fused = opt("fused", "bar", 1.0, 5.0)
    assert choose_regions([fused, epilogue]) == [epilogue]
    # Two disjoint regions together beat one that overlaps both.
    left, right, across = opt("l", "ab", 1.0, 4.0), opt("r", "cd", 1.0, 4.0), opt("x", "bc", 1.0, 5.0)
    assert choose_regions([across, left, right]) == [left, right]


def test_ties_go_to_the_first_listed_and_order_is_kept():
    first, second = opt("1", "ab", 1.0, 2.0), opt("2", "bc", 1.0, 2.0)
    assert choose_regions([first, second]) == [first]
    assert choose_regions([second, first]) == [second]


def test_large_groups_fall_back_to_greedy_by_saving():
    chain = [RegionOption(str(i), frozenset({i, i + 1}), 1.0, 2.0 + i) for i in range(20)]  # each overlaps the next
    chosen = choose_regions(chain, exact_limit=4)
    assert chosen and all(not (x.nodes & y.nodes) for x in chosen for y in chosen if x is not y)
    assert [o.card for o in chosen] == [str(i) for i in range(1, 20, 2)]  # from the largest saving down
