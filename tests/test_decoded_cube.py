"""benchmarks/decoded_cube.py: the cube's centroid error and visibility are those of the pictures."""
import math

import torch

from tests.helpers import ROOT  # noqa: F401  (puts the repository on sys.path)
from benchmarks.decoded_cube import compare, unseen_cube


def scene(cubes: list[tuple[int, int] | None], red: float = 1.0, green_blue: float = -1.0) -> torch.Tensor:
    """Grey clips [N, 3, 1, 48, 64] in [-1, 1], each with a 6x6 cube of this colour at (row, column) or none."""
    video = torch.zeros(len(cubes), 3, 1, 48, 64)
    for i, at in enumerate(cubes):
        if at is not None:
            y, x = at
            video[i, 0, 0, y:y + 6, x:x + 6] = red
            video[i, 1:, 0, y:y + 6, x:x + 6] = green_blue
    return video


def test_a_shifted_cube_is_measured_in_pixels_and_a_missing_one_as_not_shown():
    original = scene([(10, 10), (20, 30), (30, 40), None])
    # the first two decoded 3 rows and 4 columns off, the third gone (grey), the fourth frame shows no cube
    decoded = scene([(13, 14), (23, 34), None, None], red=0.5)
    got = compare(original, decoded)
    assert got["frames_with_cube"] == 3
    assert math.isclose(got["shown"], 2 / 3)
    assert got["error_px_median"] == got["error_px_mean"] == 5.0
    assert math.isclose(got["psnr_db"], 10 * math.log10(4 / float((decoded - original).pow(2).mean())), rel_tol=1e-6)


def test_a_faint_decoded_cube_is_not_shown():
    # red 0.1 above the grey green and blue in [-1, 1] is 0.05 in [0, 1] units: below the decoded threshold
    assert compare(scene([(10, 10)]), scene([(10, 10)], red=0.1, green_blue=0.0))["shown"] == 0.0


def test_a_fit_that_loses_the_cube_is_named_by_the_check():
    original = scene([(10, 10), (20, 30), (30, 40), (5, 50)])
    rows = {"lost/vae": compare(original, scene([None, None, None, None])),
            "kept/vae": compare(original, scene([(10, 10), (20, 30), (30, 40), None], red=0.5))}
    assert rows["lost/vae"]["shown"] == 0.0 and rows["kept/vae"]["shown"] == 0.75
    assert unseen_cube(rows, 0.5) == ["lost/vae: the decoded picture shows the cube in 0% of the 4 held-out frames "
                                      "that show it; --require-shown asks for 50%"]
    assert len(unseen_cube(rows, 0.8)) == 2 and unseen_cube(rows, 0.0) == []
