"""Text rendering of a Game (host side, for debugging and the gymnasium 'ansi' mode)."""
import numpy as np

from .constants import GRID, PROGRAM_NAMES
from .state import Game

_ENEMY_CHARS = "VDGC"   # virus, daemon, glitch, cryptog


def render_text(game: Game) -> str:
    """Rows top (row 5) to bottom; each cell shows 3 characters.

    @ player, X exit, [#] unsiphoned block (D data / P program), (.) siphoned
    block, V/D/G/C enemy (lower case if stunned), tN transmission hatching in N,
    + pickup, c/e credits/energy with their amount.
    """
    g = Game(np.asarray(game.stats), *(type(x)(np.asarray(x.data)) for x in game[1:]))
    b, e, t = g.board, g.enemies, g.trans
    lines = []
    for r in range(GRID - 1, -1, -1):
        cells = []
        for c in range(GRID):
            i = GRID * r + c
            here_e = [k for k in range(len(e.active)) if e.active[k] and e.row[k] == r and e.col[k] == c]
            here_t = [k for k in range(len(t.active)) if t.active[k] and t.row[k] == r and t.col[k] == c]
            if (g.row, g.col) == (r, c):
                s = " @ "
            elif here_e:
                k = here_e[-1]
                ch = _ENEMY_CHARS[e.kind[k]]
                s = f"{ch.lower() if e.stunned[k] else ch}{e.hp[k]}{'*' if len(here_e) > 1 else ' '}"
            elif here_t:
                s = f"t{min(t.turns[k] for k in here_t)} "
            elif b.block[i]:
                inner = "D" if b.block[i] == 1 else "P"
                s = f"({inner.lower()})" if b.siphoned[i] else f"[{inner}]"
            elif g.exit_cell == i:
                s = " X "
            elif b.pickup[i]:
                s = " + "
            elif b.credits[i]:
                s = f"c{b.credits[i]} "
            elif b.energy[i]:
                s = f"e{b.energy[i]} "
            else:
                s = " . "
            cells.append(s)
        lines.append(f"{r} " + "".join(cells))
    owned = [PROGRAM_NAMES[i] for i in np.flatnonzero(g.owned)]
    lines.append("   " + "".join(f" {c} " for c in range(GRID)))
    lines.append(f"stage {g.stage} turn {g.turn} hp {g.hp} credits {g.credits} energy {g.energy} "
                 f"score {g.score} siphons {g.siphons} attack {g.attack} programs {owned}")
    return "\n".join(lines)
