#!/usr/bin/env python3
"""Gives every test of the unit suite a ctest label (run after the build by tests/CMakeLists.txt).

    ctest_labels.py TESTS_CMAKE OUT_CMAKE SOURCE...

TESTS_CMAKE is the list gtest_discover_tests wrote (its add_test lines name every test the
binary holds); OUT_CMAKE gets one set_tests_properties(... LABELS ...) per label, which ctest
reads after that list. The labels:

  dist   the test starts processes: ranks through the launcher, the CLI, the rank worker, Python
         or any other program (found in its body, or in a function of its file that it calls
         and that does);
  slow   one of SLOW below (over 8 s on the 2-core CI machine);
  unit   everything else: in-process tests, the quick loop (`ctest -L unit`).

`make test` runs them all; `ctest -L unit`, `-L dist`, `-LE slow` pick a part.
"""
import os
import re
import sys

# The tests over 8 s in a full `make test` on the 2-core CI machine (ctest's
# build/Testing/Temporary/CTestCostData.txt of 2026-12-07, while a build ran beside it): seconds
# of one run. `ctest_labels.py --measure COSTDATA` prints this table again from a newer run.
SLOW = {
    "CheckpointScale.ManyRanksSaveLoadAtFewerAndMoreAndReshardTo1024AndBack": 70,
    "CheckpointCrash.KillDuringSaveLeavesALoadablePreviousCheckpoint": 48,
    "MetadataAgreement.BothReadersGiveEveryCraftedFileTheSameVerdictInTheSameWords": 44,
    "GptChecks.StoredHparamsAreCheckedLikeFlags": 35,
    "Install.OutOfTreeConsumerFindsAndLinksTessera": 31,
    "CkptTool.InspectVerifyConsolidateReshard": 31,
    "ReliabilityCrash.SigkillAtRandomMomentsOfMultiRankSavesLeavesACompleteCheckpoint": 31,
    "SyncAndAsyncCheckpoints/Chaos.KillSegvStopOfRandomRanksFinishBitIdenticalAndLeaveNothing/Async": 30,
    "StrategyResume.HybridWithTwoReplicaGroupsSavesShardedAndLoadsAnywhere": 28,
    "CkptCli.UsageErrorsExitTwoAndRangeErrorsReadWell": 28,
    "GptInitFrom.FirstLossIsTheSourceRunsLossOfThoseWeights": 28,
    "SyncAndAsyncCheckpoints/Chaos.KillSegvStopOfRandomRanksFinishBitIdenticalAndLeaveNothing/Sync": 28,
    "XlaImport.ModelMatchesTorchXlaConsolidationBitExact": 26,
    "HfDir.BrokenDirectoriesAreRefusedNamingTheTensorAndTheFile": 25,
    "XlaImport.PeakMemoryFollowsTheLargestTensorNotTheModel": 23,
    "HfExport.ShardedCheckpointOfThreeRanksLoadsInPython": 23,
    "Gpt.BadFlagsNameTheFlag": 23,
    "SyncAndAsyncCheckpoints/Chaos.KillSegvStopOfRandomRanksFinishBitIdenticalAndLeaveNothing/SyncTwoNodes": 21,
    "FabricDist.SaveAndResumeContinuesWithIdenticalLosses": 21,
    "GptChecks.NumericFlagsRefuseNonFiniteValuesAndPrintBoundsReadably": 19,
    "CpuAllocator.ProgramsFollowTheEnvironment": 19,
    "WorldSizes/CheckpointReshard.SaveAtNLoadAtEveryM/4": 19,
    "GptInitFrom.BadCheckpointsAreRefusedNamingTheKeyAndTheFile": 19,
    "FormatV2.PythonPackageReadsBothVersionsAndRefusesWhatCxxRefuses": 18,
    "XlaImport.DirectoryGlobAndFileInputs": 18,
    "WorldSizes/CheckpointReshard.SaveAtNLoadAtEveryM/3": 18,
    "ReliabilityTwoHosts.HybridShardedCheckpointAcrossTwoHostsSavesAndResumes": 18,
    "Gpt.ResumeFromAnAsyncFullCheckpointContinuesTheRun": 17,
    "XlaImport.OrigSizeSmallerThanTheShardsIsRefused": 17,
    "WorldSizes/CheckpointReshard.SaveAtNLoadAtEveryM/1": 17,
    "Gpt.FullCheckpointsCostNoMoreMemoryThanSharded": 17,
    "CpuAllocator.RepeatedLargeTensorsDoNotFaultAgain": 17,
    "WorldSizes/CheckpointReshard.SaveAtNLoadAtEveryM/2": 16,
    "CkptSafety.ToolRefusesToOverwriteItsSource": 16,
    "ResumeAuto.TrainerAtOneAndTwoRanks": 15,
    "Gpt.ResumeFromLastCheckpointContinuesTheRun": 15,
    "LauncherSignals.TermWhileAFailedRoundIsStoppedExitsWith143": 15,
    "StrategyResume.ShardedCheckpointLoadsAtOtherWorldSizesAndStrategies": 15,
    "XlaImport.OptimizerStateUnderTheOriginalNamesMatchesTheOracle": 14,
    "PythonPackage.LoadsShardedCheckpointsWrittenAtOneTwoAndThreeRanks": 14,
    "CpuAllocator.RawAllocationsAndFreesFromOtherThreads": 14,
    "Gpt.SingleAndFsdpTwoRanksWriteTheSameLosses": 14,
    "WorldSizes/StrategyParity.EveryStrategyMatchesSingleProcess/4": 13,
    "CpuAllocator.FreedMemoryServesTheNextRequestOfAnySize": 13,
    "ReliabilityBadInput.CliFlagsAreCheckedAndNamed": 13,
    "CkptTool.VerifyNamesTheBadFileAndKey": 13,
    "TrainerDist.DdpAndFsdpFitAndResumeExactlyOnTwoRanks": 13,
    "GptResumeAuto.FreshThenResumesThenSkipsACorruptedNewest": 12,
    "HfExport.GptCheckpointAsSavedAndInBf16": 12,
    "GptChecks.SecondRunOnTheSameOutStopsAtStart": 12,
    "CpuAllocator.IdleResidentBytesStayUnderTheCap": 12,
    "ReliabilityTwoHosts.PartitionedNode0IsNamedByTheOthersAfterTheTimeout": 12,
    "HfExport.BadFlagsAndExistingOutputsAreRefused": 12,
    "StrategyParityOverGloo.DdpAndFsdpMatchSingleProcess": 12,
    "WorldSizes/ShardedRanks.FromLocalShardsRejectsBadShardsOnEveryRank/4": 12,
    "MetadataAgreement.HostileMetadataAtTheSizeLimitIsRefusedInUnderAGigabyte": 12,
    "TesseraRun.PrefixesOutputAndPropagatesExitCode": 11,
    "CpuAllocator.SmallRequestsGoToMallocAndZeroBytesToNothing": 11,
    "Collectives.AllToAllUnevenAndEmpty": 11,
    "CheckpointDist.FullSaveFromShardsLoadsShardedAndPlain": 11,
    "Launcher.MaxRestartsStartsEveryRankAgainUntilTheJobSucceeds": 11,
    "FabricDist.AsyncSaveReturnsBeforeWritingAndSavesTheStateAtTheCall": 11,
    "ReliabilityTwoHosts.KilledNodeLauncherIsNamedByTheOthers": 11,
    "Launcher.MaxRestartsSpentEndsWithTheLastFailure": 11,
    "TesseraRun.FailureAfterAnotherNodeFinishedRestartsEveryNode": 11,
    "TrainerDist.ResumesFromTwoRanksOnOne": 10,
    "Blas.RestartKeepsTheProgramsName": 10,
    "GptRunDir.NewRunRefusesAnEarlierRunAndOverwriteStartsOver": 10,
    "TesseraRun.FailureAfterAnotherNodeFinishedWithNoRestartLeftFailsTheJob": 10,
    "TesseraRun.RendezvousTimeoutIsOneClearLine": 10,
    "WorldSizes/StrategyParity.EveryStrategyMatchesSingleProcess/3": 10,
    "ReliabilityBadInput.MalformedEnvironmentReachingARankNamesTheVariable": 10,
    "GptResumeAuto.FreshStartKeepsTheEarlierAttemptsMetrics": 10,
    "CollectivesOverGloo.NativeSingleTensorFormsAreOptInAndAgree": 10,
    "TesseraRun.LauncherDeathLeavesNoOrphans": 9,
    "WorldSizes/StateRanks.OptimizerStateOfShardedParametersRoundTrips/3": 9,
    "WorldSizes/EmbeddingRanks.TrainingMatchesUnshardedModel/4": 9,
    "FabricDist.AccumulationWithNoBackwardSyncEqualsLargeBatch": 9,
    "CpuAllocator.ReleasedIdleMemoryLeavesTheResidentSet": 9,
    "Blas.ProgramsChooseOpenBlasKernelsForThisCpu": 9,
    "Transports/ReliabilityDeadRankFrozen.SurvivorsOfAStoppedRankFailAfterTheTimeout/gloo": 9,
    "FabricDist.LossParityAcrossStrategiesAndWorldSizes": 9,
    "PickleHardening.DeepListIsRefusedByTheCli": 9,
    "StrategyCollectives.NoSyncAndShardGradOpIssueTheCollectivesTheyPromise": 9,
    "FabricLaunch.ExampleProgramRunsTwoRanksWithoutALauncher": 9,
    "HfDir.CliInspectsVerifiesConsolidatesReshardsAndExports": 9,
    "StoreToken.ANodeWithAnotherTokenIsRefusedNamingTheToken": 9,
    "Phases/ReliabilityDeadRank.SurvivorsFailWithinTheTimeoutAndTheLastCheckpointLoads/backward": 8,
    "CkptCli.WorldSizeIsBounded": 8,
    "TrainerLaunch.ExampleRunsAndResumes": 8,
    "Loggers.SetupAcrossRanksPicksOneDirectory": 8,
    "XlaImport.WorldSizeAndRankMismatchesNameTheFileAndKey": 8,
    "WorldSizes/ShardedRanks.FromLocalShardsRejectsBadShardsOnEveryRank/3": 8,
}

# What starts a process: the harness's helpers (tests/support) and the system's.
STARTS = re.compile(r"\b(run_ranks|spawn|run_command|run_cli|run_measured|cli|py|launch|popen|fork|"
                    r"posix_spawn|execv\w*|system)\s*\(|\bTESSERA_(WORKER|CLI|PYTHON)\b")
TEST = re.compile(r"^(TEST|TEST_F|TEST_P)\((\w+),\s*(\w+)\)", re.M)
# A function definition's head, at any indentation (a fixture's methods too): a name, its
# parameters (default values such as {} included), then '{'; control statements excluded.
FUNCTION = re.compile(r"^[ \t]*(?!(?:if|for|while|switch|catch|return|else|do)\b)[A-Za-z_][\w:<>,\s\*&]*?\b(\w+)\s*"
                      r"\((?:[^;{}()]|\{\}|\((?:[^()]|\([^()]*\))*\))*\)\s*(?:const\s*)?(?:override\s*)?\{", re.M)


def blocks(text, pattern):
    """(match, body) for each match of `pattern` at a line start, the body up to the next one."""
    found = list(pattern.finditer(text))
    ends = sorted(set(m.start() for m in TEST.finditer(text)) | set(m.start() for m in FUNCTION.finditer(text)))
    for m in found:
        nxt = [e for e in ends if e > m.start()]
        yield m, text[m.start():nxt[0] if nxt else len(text)]


def starting_functions(bodies, starting):
    """`starting` grown by the functions of `bodies` that call one of them, until none is added."""
    starting = set(starting)
    while True:
        more = {f for f, b in bodies.items() if f not in starting and
                any(re.search(r"\b%s\s*\(" % re.escape(g), b) for g in starting)}
        if not more:
            return starting
        starting |= more


def classify(sources):
    """{(suite, name, parameterized): starts processes}"""
    # The helpers of the suite's headers (tests/*/*.h) that start a process: a test that calls
    # one (gpt_test_util.h's, checkpoint_test_util.h's, ...) starts one.
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shared = {}
    for folder, _, files in os.walk(tests_dir):
        for f in files:
            if f.endswith(".h"):
                text = open(os.path.join(folder, f), encoding="utf-8").read()
                shared.update({m.group(1): body for m, body in blocks(text, FUNCTION)})
    shared_starting = starting_functions(shared, {f for f, b in shared.items() if STARTS.search(b)})
    out = {}
    for path in sources:
        text = open(path, encoding="utf-8").read()
        # Functions of this file that start a process, directly or through another one.
        bodies = {m.group(1): body for m, body in blocks(text, FUNCTION)}
        starting = starting_functions(bodies, shared_starting | {f for f, b in bodies.items() if STARTS.search(b)})
        calls = re.compile(r"\b(%s)\s*\(" % "|".join(map(re.escape, sorted(starting)))) if starting else None
        for m, body in blocks(text, TEST):
            dist = bool(STARTS.search(body) or (calls and calls.search(body)))
            out[(m.group(2), m.group(3), m.group(1) == "TEST_P")] = dist
    return out


def plain(name):
    """A test's name without gtest's "  # GetParam() = ..." (which may hold addresses)."""
    return name.split("  #", 1)[0]


def measure(costdata, over=8.0):
    """SLOW's table from ctest's cost data: the tests over `over` seconds, slowest first."""
    cost = {}
    for line in open(costdata, encoding="utf-8"):
        parts = line.rsplit(" ", 2)
        if len(parts) == 3 and re.fullmatch(r"[\d.]+", parts[2].strip()):
            cost[parts[0]] = float(parts[2])
    print("SLOW = {")
    for t in sorted((t for t in cost if cost[t] > over), key=lambda t: -cost[t]):
        if not t.startswith("Layers."):  # labelled in tests/CMakeLists.txt
            print('    "%s": %d,' % (plain(t), round(cost[t])))
    print("}")


def main():
    if sys.argv[1:2] == ["--measure"]:
        return measure(sys.argv[2])
    tests_cmake, out_cmake, *sources = sys.argv[1:]
    names = re.findall(r"^add_test\(\[=\[(.*?)\]=\]", open(tests_cmake, encoding="utf-8").read(), re.M)
    kinds = classify(sources)
    labels = {}  # test -> its labels
    unknown = []
    for n in names:
        # TEST_P names read "Instantiation/Suite.Name/param  # GetParam() = ...".
        m = re.fullmatch(r"(\w+/)?(\w+)\.(\w+)(/\w+)?(\s+#.*)?", n, re.S)
        key = m and (m.group(2), m.group(3), m.group(1) is not None)
        if not key or key not in kinds:
            unknown.append(n)
            continue
        labels[n] = ["dist" if kinds[key] else "unit"] + (["slow"] if plain(n) in SLOW else [])
    stale = sorted(set(SLOW) - set(plain(n) for n in names))
    if unknown or stale:
        sys.exit("ctest_labels.py: %s%s" % (
            "no TEST in the sources for: " + ", ".join(unknown) + " " if unknown else "",
            "SLOW names tests that do not exist: " + ", ".join(stale) if stale else ""))
    groups = {}
    for n, ls in labels.items():
        groups.setdefault(";".join(ls), []).append(n)
    with open(out_cmake + ".tmp", "w", encoding="utf-8") as f:
        f.write("# Generated by tests/support/ctest_labels.py after each build: one ctest label per test.\n")
        for ls, tests in sorted(groups.items()):
            for i in range(0, len(tests), 200):
                quoted = " ".join("[=[%s]=]" % t for t in tests[i:i + 200])
                f.write("set_tests_properties(%s PROPERTIES LABELS [=[%s]=])\n" % (quoted, ls))
    os.replace(out_cmake + ".tmp", out_cmake)
    count = lambda l: sum(l in ls for ls in labels.values())
    print("ctest labels: %d unit, %d dist, %d slow" % (count("unit"), count("dist"), count("slow")))


if __name__ == "__main__":
    main()
