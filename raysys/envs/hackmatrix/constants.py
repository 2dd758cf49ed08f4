"""Static tables of HackMatrix (docs/hackmatrix.md, RULES.md §1, §5, §7, §10).

Everything here is a plain Python/NumPy constant: jitted code folds it in, so
looking a value up by a traced index costs one tiny gather and no Python.
"""
import numpy as np

GRID = 6                      # the board is GRID x GRID; row 0 is the bottom
N_CELLS = GRID * GRID         # board layers are stored flat: cell = GRID*row + col
MAX_UNITS = 20                # slots for enemies and, separately, transmissions
N_PROGRAMS = 23
N_ACTIONS = 5 + N_PROGRAMS    # 0-3 move/attack, 4 siphon, 5+i program i
N_CHANNELS = 42
N_PLAYER = 10
OBS_SIZE = N_PLAYER + N_PROGRAMS + N_CELLS * N_CHANNELS   # 1545

MAX_HP = 3
MAX_ATTACK = 3
LAST_STAGE = 8
SPAWN_INTERVAL = 12           # turns between scheduled transmissions
SIPHON_DELAY = 5              # a siphon pushes the next scheduled spawn back
MAX_SIPHON_SPAWN = 9          # at most this many transmissions per siphon
SIPHON_SPAWN_TURNS = 3
MAX_STAGE_TRANSMISSIONS = 8
BLOCKS_MIN, BLOCKS_MAX = 5, 11

# Actions 0-4; a program i is action PROGRAM_BASE + i.
UP, DOWN, LEFT, RIGHT, SIPHON = range(5)
PROGRAM_BASE = 5
DIRECTIONS = np.array([[1, 0], [-1, 0], [0, -1], [0, 1]], np.int32)   # (drow, dcol)

# Programs, in action order.
(PUSH, PULL, CRASH, WARP, POLY, WAIT, DEBUG, ROW, COL, UNDO, STEP, SIPH_PLUS,
 EXCH, SHOW, RESET, CALM, D_BOM, DELAY, ANTI_V, SCORE, REDUC, ATK_PLUS, HACK) = range(N_PROGRAMS)
PROGRAM_NAMES = ("PUSH", "PULL", "CRASH", "WARP", "POLY", "WAIT", "DEBUG", "ROW", "COL",
                 "UNDO", "STEP", "SIPH+", "EXCH", "SHOW", "RESET", "CALM", "D_BOM",
                 "DELAY", "ANTI-V", "SCORE", "REDUC", "ATK+", "HACK")
PROGRAM_CREDITS = np.array([0, 0, 3, 2, 1, 0, 3, 3, 3, 1, 0, 5, 4, 2, 0, 2, 3, 1, 3, 0, 2, 4, 2], np.int32)
PROGRAM_ENERGY = np.array([2, 2, 2, 2, 1, 1, 0, 1, 1, 0, 3, 0, 0, 0, 4, 4, 0, 2, 0, 5, 1, 4, 2], np.int32)
ALL_PROGRAMS = (1 << N_PROGRAMS) - 1   # EnvParams.start_programs bitmask owning everything
ACTION_NAMES = ("UP", "DOWN", "LEFT", "RIGHT", "SIPHON") + PROGRAM_NAMES

# Enemies.
VIRUS, DAEMON, GLITCH, CRYPTOG = range(4)
N_ENEMY_TYPES = 4
ENEMY_HP = np.array([2, 3, 2, 2], np.int32)

# Blocks (question blocks exist in the encoding but are never generated).
NO_BLOCK, DATA_BLOCK, PROGRAM_BLOCK, QUESTION_BLOCK = range(4)
PROGRAM_RANK = 100            # a program outranks any data block when siphoning

CORNERS = np.array([0, GRID - 1, GRID * (GRID - 1), N_CELLS - 1], np.int32)
IS_CORNER = np.isin(np.arange(N_CELLS), CORNERS)

# Reward of completing stage s is STAGE_REWARDS[s - 1]; the death penalty uses the
# sum of the rewards of the stages below the current one.
STAGE_REWARDS = np.array([1, 2, 4, 8, 16, 32, 64, 100], np.float32)
STAGE_REWARDS_BELOW = np.concatenate([[0.0], np.cumsum(STAGE_REWARDS)]).astype(np.float32)
