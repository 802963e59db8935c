// The requests of the fault-tolerant trainers (corpc/ddp/quorum.hpp): four to the quorum coordinator
// (quorum_coordinator.cpp), one to a donor and one from the coordinator to a member (both ft_member.cpp). Declared here
// so that caller and callee name the same functions; each is registered to run on the I/O thread in the file that
// defines it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "corpc/core/future.hpp"

namespace corpc::ddp::ft_detail {

// A quorum as the coordinator answers it: (epoch, step, members, the member this rank recovers from or -1, the
// members this rank serves its state to, and why the last attempt that was not committed failed, as known now: its
// epoch and reason). The reason may be better than the vote's answer was: a member lost is often seen only after a
// survivor's failed collective, the loss's consequence, has voted the step down.
using QuorumAnswer =
    std::tuple<std::int64_t, std::int64_t, std::vector<int>, int, std::vector<int>, std::int64_t, std::string>;

// Asked by every trainer at the start of each attempt at a step: `committed` steps are in its state (`has_state`:
// false for a replacement that holds nothing yet); `failed`: its last attempt was not committed. `replica_groups`:
// the replicas the trainer takes part in (empty: a replica of its own); the coordinator refuses a trainer whose groups
// are not its own with UsageError (as groups_check does).
Future<QuorumAnswer> quorum_request(int rank, std::int64_t committed, bool has_state, bool failed,
                                    std::vector<std::vector<int>> replica_groups);

// Asked by every trainer as it is made: the coordinator's UsageError if its replica groups are not `replica_groups`
// (ft_messages.hpp's replica_groups_mismatch, naming the fix), so that a misconfigured job is refused before it
// trains, not after a loss. Waits for the coordinator to be made, as a quorum request does.
Future<bool> groups_check(int rank, std::vector<std::vector<int>> replica_groups);

// The outcome of a vote: (committed, and if not, why: ft_messages.hpp's not_committed, naming the step, the cause and
// the worker it concerns).
using CommitAnswer = std::tuple<bool, std::string>;

// A vote without the next step's request, as trainers before 0.10.5 send it. Every member's vote after its forward and
// backward of `step` in `epoch`, with its own failure (empty: it succeeded):
// committed once all members voted without one; not if any failed, died, or did not vote within the join timeout
// (the step is then taken by nobody).
Future<CommitAnswer> commit_request(int rank, std::int64_t epoch, std::int64_t step, std::string error);

// The vote of commit_request, and, if the step is committed, this rank's request for the next step's quorum (step + 1
// steps committed, with state), made by the coordinator the moment it commits: one request a step instead of two.
// (committed, why not, has_next, the next quorum): has_next is false when the vote failed, or when the round that
// request joined did not close at the commit (a replica is incomplete, or no member can be given the state): the
// trainer then asks with quorum_request at its next step, and learns why there.
using VoteAnswer = std::tuple<bool, std::string, bool, QuorumAnswer>;
Future<VoteAnswer> commit_and_ask(int rank, std::int64_t epoch, std::int64_t step, std::string error);

// Asked of a donor by a member that recovers: the donor's state at the boundary of `epoch`'s first step (parameters,
// buffers, the optimizer's archive as bytes, the step counter), once the donor has taken it.
Future<std::vector<at::Tensor>> state_request(std::int64_t epoch);

// To a member of a replica group (the trainer that registered as this process's member): the attempt at `step` in `epoch` is taken by nobody (a member was lost, or the vote
// failed: `why`, as not_committed says it); a worker still running it stops waiting for its replica mates. Nothing
// where no such attempt runs.
void abort_attempt(std::int64_t epoch, std::int64_t step, std::string why);

}  // namespace corpc::ddp::ft_detail
