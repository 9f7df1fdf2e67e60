"""Plain-Python references for returns (1-D lists, explicit loops, obviously correct), shared by
the tests of `diskreplay.episodes.returns`, `RolloutBuffer` and the episodic-return field."""


def ref_discount_cumsum(x, gamma, dones):
    T = len(x)
    y = [0.0] * T
    for t in range(T):
        total, disc = 0.0, 1.0
        for s in range(t, T):
            total += disc * float(x[s])
            if dones[s]:
                break
            disc *= gamma
        y[t] = total
    return y


def ref_gae(rewards, values, terminated, truncated, last_value, last_terminated, gamma, lam,
            next_values=None):
    """Per-env reference.  next_values=None -> values[t+1] / last_value, values[t] at truncations."""
    T = len(rewards)
    term = [bool(terminated[t]) for t in range(T)]
    if T and last_terminated:
        term[T - 1] = True
    adv = [0.0] * T
    for t in range(T):
        # sum over the lambda-chain, stopping at the end of t's episode
        total, w = 0.0, 1.0
        for s in range(t, T):
            if next_values is not None:
                nv = float(next_values[s])
            elif truncated[s] and not term[s]:
                nv = float(values[s])
            elif s + 1 < T:
                nv = float(values[s + 1])
            else:
                nv = float(last_value)
            boot = 0.0 if term[s] else gamma * nv
            delta = float(rewards[s]) + boot - float(values[s])
            total += w * delta
            if term[s] or truncated[s]:
                break
            w *= gamma * lam
        adv[t] = total
    return adv


def ref_nstep(rewards, terminated, truncated, n, gamma):
    T = len(rewards)
    rets, discs, ks = [], [], []
    for t in range(T):
        k, total = 0, 0.0
        while True:
            total += gamma**k * float(rewards[t + k])
            k += 1
            s = t + k - 1
            if k == n or terminated[s] or truncated[s] or t + k == T:
                break
        rets.append(total)
        ks.append(k)
        discs.append(0.0 if terminated[t + k - 1] else gamma**k)
    return rets, discs, ks


def ref_episodic(rewards, done, gamma, default, clip):
    T = len(rewards)
    rets, complete = [], []
    for t in range(T):
        total, disc, finished = 0.0, 1.0, False
        for s in range(t, T):
            r = float(rewards[s])
            if clip is not None:
                r = min(max(r, clip[0]), clip[1])
            total += disc * r
            disc *= gamma
            if done[s]:
                finished = True
                break
        rets.append(total if finished else default)
        complete.append(finished)
    return rets, complete
