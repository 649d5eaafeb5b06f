-- A live migration's handover: the lease this one takes its device over from (its
-- token names it, and the lender hands the device over when that lease's holder lets
-- go); NULL: an ordinary lease.
ALTER TABLE leases ADD COLUMN successor_of TEXT;
