//! `job.state_dir` on GCS (fake-gcs-server on 127.0.0.1): the checks every
//! object store must pass (`state_object`), run here on GCS, where records
//! are objects created once (`ifGenerationMatch=0`) and the lease is swapped
//! on its generation. (`state_s3`'s throttled swap of `current` needs a
//! server that fails chosen requests, which fake-gcs-server cannot.) The
//! host reaches the server as Google's client libraries reach an emulator,
//! through `STORAGE_EMULATOR_HOST` (unsigned requests), set once for this
//! process (`sluice_tests::harness::gcs`) and inherited by the `sluice run`
//! processes it starts.

use crate::state_object::{Backend, backend_tests};

backend_tests! { Backend::Gcs;
    a_job_with_its_state_on_gcs_resumes_after_a_crash_and_lands_every_row_once =>
        a_job_with_its_state_in_a_bucket_resumes_after_a_crash_and_lands_every_row_once,
    a_second_live_run_refuses_while_the_first_holds_the_lease => a_second_live_run_refuses_while_the_first_holds_the_lease,
    after_a_sigkill_the_next_run_takes_the_lease_over_once_it_expired =>
        after_a_sigkill_the_next_run_takes_the_lease_over_once_it_expired,
    a_holder_whose_compare_and_swap_fails_stops_before_its_next_write =>
        a_holder_whose_compare_and_swap_fails_stops_before_its_next_write,
    a_lease_renewed_by_a_holder_with_a_lagging_clock_is_not_taken_over =>
        a_lease_renewed_by_a_holder_with_a_lagging_clock_is_not_taken_over,
    a_frozen_holder_that_wakes_after_a_takeover_changes_nothing => a_frozen_holder_that_wakes_after_a_takeover_changes_nothing,
    a_holder_frozen_before_its_first_commit_changes_nothing => a_holder_frozen_before_its_first_commit_changes_nothing,
    a_holder_frozen_before_a_commit_changes_nothing => a_holder_frozen_before_a_commit_changes_nothing,
    a_holder_frozen_before_its_record_lands_changes_nothing => a_holder_frozen_before_its_record_lands_changes_nothing,
    a_lease_deleted_after_an_interrupted_takeover_does_not_adopt_the_partial_copy =>
        a_lease_deleted_after_an_interrupted_takeover_does_not_adopt_the_partial_copy,
}
